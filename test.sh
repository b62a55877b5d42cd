#!/usr/bin/env bash
# Set up everything the tests need, then run the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest -q "$@"
