#!/usr/bin/env bash
# Install megatron-core for moe_dispatcher's Megatron integration into the current Python (torch first):
#   bash tools/install_megatron.sh
# megatron-core >= 0.17 declares Requires-Python >= 3.12 yet ships cp311 wheels, and lists only torch,
# numpy and packaging as needs; on Python 3.11 a plain `pip install megatron-core` refuses (or drags in an
# unbuildable numpy). So: its real needs from requirements/megatron.txt, then the wheel itself without
# pip's metadata checks. Works the same on 3.12+. PYTHON and MEGATRON_CORE_VERSION override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VERSION=${MEGATRON_CORE_VERSION:-0.19.2}
"$PYTHON" -c "import torch" 2>/dev/null || { echo "install_megatron.sh: install torch first" >&2; exit 1; }
"$PYTHON" -m pip install -r requirements/megatron.txt
"$PYTHON" -m pip install --no-deps --ignore-requires-python "megatron-core==$VERSION"
"$PYTHON" -W ignore -c "import megatron.core; print('megatron-core', megatron.core.__version__, 'ready')"
