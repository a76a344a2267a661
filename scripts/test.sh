#!/usr/bin/env bash
# The test job: set up .venv if needed, lint, check the formatting, type-check src/, then run the
# test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check src tests scripts
.venv/bin/ruff format --check src tests scripts
.venv/bin/mypy
# Two workers: much of the suite waits on servers, subprocesses and timers past their
# deadlines, so two processes on two cores take ~40 % less wall time than one. Tests that start
# a Ray cluster carry `xdist_group("ray")`: one worker runs them, one cluster at a time.
exec .venv/bin/python -m pytest -n "${MSTAR_TEST_WORKERS:-2}" --dist loadgroup "$@"
