#!/usr/bin/env bash
# The main job: set up .venv if needed, then run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/mstar demo "$@"
