#!/usr/bin/env bash
# Set up, then capture the default model's attention on a sample text and print its sink report.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
.venv/bin/attnviz capture --text "${ATTNVIZ_TEXT:-The quick brown fox jumps over the lazy dog, and the dog sleeps on.}" \
  --arch "${ATTNVIZ_ARCH:-fwd}" --out captures/example.npz
