#!/usr/bin/env bash
# The test job: set up .venv if needed, lint, check the formatting, type-check src/, then run the
# test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check src tests scripts
.venv/bin/ruff format --check src tests scripts
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
