#!/usr/bin/env bash
# Why is the fused expert-major combine ~3 ms when the rank-major combine of the same exchange is ~0.7 ms?
# One 4-GPU run, < 3 minutes, after the build (STEPS=build bash tools/gpu_suite.sh 4); everything in $OUT:
#
#   bash tools/gpu_em_diag.sh
#
#   1. python -m moe_dispatcher.bench --mode expert-major: on ONE routing (4096 tokens/rank, H 7168, top-8 of
#      256, Buffer default 20 SMs), rank-major dispatch/combine, expert-major dispatch (fresh bound / fresh exact
#      / cached), expert-major combine (plain, +weights, +topk_weights) in BOTH variants ("fused": the combine
#      kernel's senders gather and sum the expert rows, the old path; "split": em_unpermute over the whole GPU,
#      then the rank-major combine), the torch composition, NCCL all_to_all. Each case back to back ("b2b") and
#      after a device-wide barrier per call ("synced"): b2b - synced = skew between ranks. It also checks both
#      variants bit for bit against the composition (a note; the run fails if not).
#   2. tests/test_expert_major_gpu.py::test_fused_expert_major_matches[4] twice: MOE_DISPATCHER_EM_COMBINE=split
#      (the default) and =fused (bit-exact vs the composition, vs reference, overflow, CUDA graph).
#
# Reading the table: if "em combine [split]" synced ~ "torch unpermute"-like local cost + "rank-major combine",
# and "em combine [fused]" stays ~3 ms synced, the fused senders' local gather on 2 x channels SMs is the cost
# (keep split). If fused synced is near rank-major and only b2b is slow, it is skew (a late peer), not the kernel.
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1 MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-120} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/logs"
N=${N:-4}
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1 && [ -z "${PYTHONPATH:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
summary="$OUT/em_diag_summary.txt"
: > "$summary"
start=$(date +%s)
run() {  # run NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $name ($(( $(date +%s) - t0 )) s)" | tee -a "$summary"
  if ((rc != 0)); then
    grep -E "^E |FAILED|Error|error:|Fatal Python error|Segmentation|exited with code|File \"|note:" \
      "$OUT/logs/$name.log" | grep -v "^E  *$" | head -n 40 | sed 's/^/    /' | tee -a "$summary"
  fi
  tail -n 4 "$OUT/logs/$name.log" | sed 's/^/    /' | tee -a "$summary"
}
run bench_expert_major 120 python3 -m moe_dispatcher.bench --mode expert-major --backend kernels --num-ranks "$N" \
  --iters 30 --warmup 8 --out-dir "$OUT"
sed -n '/^## Expert-major/,/^## Notes/p' "$OUT/logs/bench_expert_major.log" >> "$summary" 2>/dev/null
grep -E "note:" "$OUT/logs/bench_expert_major.log" >> "$summary" 2>/dev/null
for mode in split fused; do
  run "em_gpu_test_$mode" 60 env MOE_DISPATCHER_EM_COMBINE=$mode python3 -m pytest -q -m gpu -p no:cacheprovider -x \
    -rf --tb=short "tests/test_expert_major_gpu.py::test_fused_expert_major_matches[$N]"
done
echo "total $(( $(date +%s) - start )) s" >> "$summary"
cat "$summary"
