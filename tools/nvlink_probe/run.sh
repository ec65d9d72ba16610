#!/usr/bin/env bash
# Builds tools/nvlink_probe/nvlink_probe.cu and prints its tables for 2 GPUs and for every visible GPU
# (when more than 2). Extra arguments go to the probe (e.g. --sms 8,24 --threads 1024 --iters 50).
# Needs nvcc (CUDA 12.x/13, sm_90a) and >= 2 GPUs with peer access. Exit status: non-zero if the build
# fails, a design fails its data check (3), a wait times out (2) or a run exceeds its time limit (124).
#
#   bash tools/nvlink_probe/run.sh [PROBE_ARGS...]
#   NVLINK_PROBE_BIN=/tmp/nvlink_probe GPUS="2 4" bash tools/nvlink_probe/run.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
bin=${NVLINK_PROBE_BIN:-/tmp/nvlink_probe}
nvcc -arch=sm_90a -O3 -o "$bin" tools/nvlink_probe/nvlink_probe.cu || exit 1
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then n=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
else n=$(nvidia-smi -L | grep -c '^GPU'); fi
gpus=${GPUS:-$( [ "$n" -gt 2 ] && echo "2 $n" || echo "$n" )}
status=0
for g in $gpus; do
  echo "=== $g GPUs ==="
  timeout 300 "$bin" --gpus "$g" "$@"
  rc=$?
  [ $rc -ne 0 ] && { echo "nvlink_probe --gpus $g: exit status $rc"; status=$rc; }
done
exit $status
