#!/usr/bin/env bash
# One call on a lent GPU machine: build the extension, run the GPU tests, the benchmarks (ours beside NCCL)
# and the Megatron layer benchmark, for N GPUs (default: every visible GPU) and for 2, highest priority
# first, stopping before DEADLINE_S seconds have passed. Everything lands in $OUT (default ./gpu-out) and is
# packed into $OUT/results.tgz (the device tool brings back only a few files).
#
#   bash tools/gpu_suite.sh [N]            e.g. N=8 on an 8-GPU machine
#   STEPS="build tests bench" bash tools/gpu_suite.sh 4
#   TESTS="tests/test_intranode_gpu.py" TEST_LIMIT_S=200 STEPS="build tests" bash tools/gpu_suite.sh 4
# Python wheels the image lacks (nvshmem4py, megatron-core) are taken from .whl/ when present; the Megatron
# yardstick is read from $LAYER_BENCH (default .out/megatron_layer_bench.py, a copy of
# shared/tools/megatron_layer_bench.py).
set -u
export MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-120} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/logs"
N=${1:-$(nvidia-smi -L | wc -l)}
STEPS=${STEPS:-"build tests bench megatron"}
DEADLINE_S=${DEADLINE_S:-540}
LAYER_BENCH=${LAYER_BENCH:-.out/megatron_layer_bench.py}
start=$(date +%s)
summary="$OUT/summary.txt"
: > "$summary"

source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
has() { [[ " $STEPS " == *" $1 "* ]]; }

if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } >> "$summary" 2>&1

has build && run build 240 env MAX_JOBS=32 MOE_DISPATCHER_BUILD_EXT=1 python3 -m pip install --no-deps --no-build-isolation -v -e .
if has bench; then
  run bench_normal_${N} 150 python3 -m moe_dispatcher.bench --mode normal --backend kernels --num-ranks "$N" --plot-sweep --out-dir "$OUT"
  (( N != 2 )) && run bench_normal_2 90 python3 -m moe_dispatcher.bench --mode normal --backend kernels --num-ranks 2 --out-dir "$OUT"
  run bench_ll_${N} 90 python3 -m moe_dispatcher.bench --mode low-latency --num-ranks "$N" --out-dir "$OUT"
fi
if has tests; then
  # One step per test file (its own log and time limit), so a slow or hung file costs only itself.
  for t in ${TESTS:-$(grep -l "mark.gpu\|BACKENDS" tests/test_*.py)}; do
    run "gpu_$(basename "$t" .py)" "${TEST_LIMIT_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short "$t"
  done
fi
if has megatron && [ -f "$LAYER_BENCH" ]; then
  run megatron_layer_bench_${N} 180 torchrun --standalone --nproc_per_node "$N" "$LAYER_BENCH"
fi
echo "total $(( $(date +%s) - start )) s" >> "$summary"
tar czf "$OUT/results.tgz" -C "$OUT" --exclude results.tgz . 2>/dev/null
cat "$summary"
