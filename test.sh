#!/usr/bin/env bash
# Set up everything the tests need, then run the whole suite. Extra arguments go to pytest.
# The suite runs in ATTNVIZ_TEST_WORKERS processes (pytest-xdist, default 2: this machine's cores), each test file
# whole in one of them (its module's models and captures built once); `bash test.sh -n 0 FILE` runs in this process.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest -q -n "${ATTNVIZ_TEST_WORKERS:-2}" --dist loadfile "$@"
