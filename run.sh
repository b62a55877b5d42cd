#!/usr/bin/env bash
# Set up (first time: packages, the offline default model, Debian's chromium for figure export),
# then start the app on http://localhost:8501 with the default model and a ready example.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/python -m streamlit run app.py "$@"
