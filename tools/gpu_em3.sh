#!/usr/bin/env bash
# Expert-major variants side by side: split vs fused dispatch (MOE_DISPATCHER_EM_DISPATCH) and combine
# (MOE_DISPATCHER_EM_COMBINE), the split variants' local passes alone, and their correctness. One 4-GPU run,
# ~150 s, after the build (STEPS=build bash tools/gpu_suite.sh 4; export PYTHONPATH=/tmp/site); logs in $OUT:
#
#   bash tools/gpu_em3.sh
#
#   1. tests/test_expert_major_gpu.py::test_fused_expert_major_matches[4] with MOE_DISPATCHER_EM_COMBINE=split
#      and =fused; each run checks BOTH dispatch variants (bit-exact vs the composition, vs reference,
#      overflow, CUDA graph), so all four (dispatch, combine) pairs are covered.
#   2. python -m moe_dispatcher.bench --mode expert-major: one routing (4096 tokens/rank, H 7168, top-8 of 256,
#      Buffer default 20 SMs): rank-major dispatch/combine, em dispatch (fresh num_worst_tokens / fresh exact /
#      cached) x (split, fused), em combine (plain / +weights / +topk_weights) x (split, fused), em_permute and
#      em_unpermute alone (notes: their GB/s of HBM traffic), the torch composition, NCCL all_to_all. It also
#      checks every variant bit for bit against the others / the composition (notes; fails if not).
#   3. tests/test_megatron_layer.py (GPU parity of the Megatron dispatcher; default variants: split + split).
#
# Reading it: "em dispatch cached [split]" should be about "rank-major dispatch (cached)" + the em_permute line
# (~0.7 GB at HBM speed, ~0.17-0.2 ms); "em combine [split]" about "rank-major combine" + em_unpermute.
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1 MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-120} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/logs"
N=${N:-4}
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1 && [ -z "${PYTHONPATH:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
summary="$OUT/summary_em3.txt"
: > "$summary"
start=$(date +%s)
run() {  # run NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $name ($(( $(date +%s) - t0 )) s)" | tee -a "$summary"
  if ((rc != 0)); then
    grep -E "^E |FAILED|Error|error:|Fatal Python error|Segmentation|exited with code|File \"|note:|case " \
      "$OUT/logs/$name.log" | grep -v "^E  *$" | head -n 40 | sed 's/^/    /' | tee -a "$summary"
  fi
  tail -n 3 "$OUT/logs/$name.log" | sed 's/^/    /' | tee -a "$summary"
}
for mode in split fused; do
  run "em_gpu_test_combine_$mode" 60 env MOE_DISPATCHER_EM_COMBINE=$mode python3 -m pytest -q -m gpu \
    -p no:cacheprovider -x -rf --tb=short "tests/test_expert_major_gpu.py::test_fused_expert_major_matches[$N]"
done
run bench_expert_major 100 python3 -m moe_dispatcher.bench --mode expert-major --backend kernels --num-ranks "$N" \
  --iters 30 --warmup 8 --out-dir "$OUT"
sed -n '/^## Expert-major/,/^## Notes/p' "$OUT/logs/bench_expert_major.log" >> "$summary" 2>/dev/null
grep -E "note:" "$OUT/logs/bench_expert_major.log" >> "$summary" 2>/dev/null
run megatron_layer_gpu 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_megatron_layer.py
echo "total $(( $(date +%s) - start )) s" >> "$summary"
cat "$summary"
