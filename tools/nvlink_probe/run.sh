#!/usr/bin/env bash
# Builds tools/nvlink_probe/nvlink_probe.cu and prints its tables for every visible GPU, then for 2 GPUs
# (when more than 2 are visible). Extra arguments go to the probe (e.g. --sms 8,24 --threads 1024 --iters 50).
# Needs nvcc (CUDA 12.x/13, sm_90a; from PATH, else $CUDA_HOME/bin, else /usr/local/cuda/bin) and >= 2 GPUs
# with peer access. Exit status: non-zero if the build fails (1), a design fails its data check (3), a wait
# times out (2) or a run exceeds its time limit (124).
#
#   bash tools/nvlink_probe/run.sh [PROBE_ARGS...]
#   NVLINK_PROBE_BIN=/tmp/nvlink_probe GPUS="4 2" bash tools/nvlink_probe/run.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
bin=${NVLINK_PROBE_BIN:-/tmp/nvlink_probe}
nvcc=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
"$nvcc" -arch=sm_90a -O3 -o "$bin" tools/nvlink_probe/nvlink_probe.cu || exit 1
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then n=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
else n=$(nvidia-smi -L | grep -c '^GPU'); fi
# the links the tables are read against (NVSwitch or direct NVLink, how many per pair)
nvidia-smi topo -m 2>/dev/null || true
export CUDA_MODULE_LOADING=EAGER  # the probe sets it too; here it also holds should the runtime read it early
# the full mesh first: it is the table that matters, should the device time run out
gpus=${GPUS:-$( [ "$n" -gt 2 ] && echo "$n 2" || echo "$n" )}
status=0
for g in $gpus; do
  echo "=== $g GPUs ==="
  timeout 120 "$bin" --gpus "$g" "$@"
  rc=$?
  [ $rc -ne 0 ] && { echo "nvlink_probe --gpus $g: exit status $rc"; status=$rc; }
done
exit $status
