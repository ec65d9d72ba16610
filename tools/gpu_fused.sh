#!/usr/bin/env bash
# The fused expert-major work on a 4-GPU machine, after the build (tools/gpu_suite.sh does it, or
# STEPS=build bash tools/gpu_suite.sh 4). One command, < 5 minutes, everything in $OUT:
#
#   bash tools/gpu_fused.sh
#
#   1. tests/test_expert_major_gpu.py (fused vs composition bit-exact, vs reference, overflow, CUDA graph)
#      and the expert-major / Megatron GPU tests already in the suite;
#   2. the yardstick: torchrun 4 x .out/megatron_layer_bench.py (or shared/tools/megatron_layer_bench.py);
#   3. tools/profile_round_trip.py: our round trip timed, steady-state host syncs counted, torch.profiler's
#      top ops by CUDA and CPU time ($OUT/round_trip_profile.txt, $OUT/round_trip_trace.json.gz).
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1 MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-120} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/logs"
N=${N:-4}
LAYER_BENCH=${LAYER_BENCH:-.out/megatron_layer_bench.py}
[ -f "$LAYER_BENCH" ] || LAYER_BENCH=shared/tools/megatron_layer_bench.py
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1 && [ -z "${PYTHONPATH:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
summary="$OUT/fused_summary.txt"
: > "$summary"
start=$(date +%s)
run() {  # run NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $name ($(( $(date +%s) - t0 )) s)" | tee -a "$summary"
  if ((rc != 0)); then  # the failure itself: assertion lines, failed tests, crashed ranks' stacks (faulthandler)
    grep -E "^E |FAILED|Error|error:|Fatal Python error|Segmentation|exited with code|File \"" "$OUT/logs/$name.log" \
      | grep -v "^E  *$" | head -n 40 | sed 's/^/    /' | tee -a "$summary"
  fi
  tail -n 6 "$OUT/logs/$name.log" | sed 's/^/    /' | tee -a "$summary"
}
run fused_gpu_tests 100 python3 -m pytest -q -m gpu -p no:cacheprovider -x -rf --tb=short \
  "tests/test_expert_major_gpu.py::test_fused_expert_major_matches[$N]" tests/test_expert_major.py
run megatron_gpu_parity 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_megatron_layer.py -k gpus
run megatron_layer_bench_${N} 120 torchrun --standalone --nproc_per_node "$N" "$LAYER_BENCH"
OUT="$OUT" run round_trip_profile 90 torchrun --standalone --nproc_per_node "$N" tools/profile_round_trip.py
grep -E "round trip|layer fwd" "$OUT/logs/megatron_layer_bench_${N}.log" >> "$summary" 2>/dev/null
sed -n 1,12p "$OUT/round_trip_profile.txt" >> "$summary" 2>/dev/null
echo "total $(( $(date +%s) - start )) s" >> "$summary"
cat "$summary"
