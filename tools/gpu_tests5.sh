#!/usr/bin/env bash
# The three normal-mode GPU test files after their shared logic moved to tests/normal_cases.py (branch tests5),
# on 4 GPUs, after `STEPS=build bash tools/gpu_suite.sh 4` (~3 minutes). Logs in $OUT, summary in
# $OUT/summary_tests5.txt (printed). Run from the repo root with PYTHONPATH=<this tree>:/tmp/site.
set -u
export OUT=${OUT:-./gpu-out}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-120} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}
mkdir -p "$OUT"
summary="$OUT/summary_tests5.txt"
: > "$summary"
PYTEST=(python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfE --tb=short)
for f in intranode internode expert_major; do
  timeout 240 "${PYTEST[@]}" "tests/test_${f}_gpu.py" > "$OUT/${f}.txt" 2>&1
  echo "test_${f}_gpu.py: rc=$?" >> "$summary"
  grep -E "passed|failed|FAILED|^E  |bit-exact" "$OUT/${f}.txt" | tail -20 >> "$summary"
done
cat "$summary"
