#!/usr/bin/env bash
# Install fuser and what its tests need. torch comes first and pinned when absent: an unpinned `torch`
# would pull a multi-GB CUDA build where the CPU wheel 2.13.0 is available locally.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
