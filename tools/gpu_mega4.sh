#!/usr/bin/env bash
# Megatron dispatcher, expert-row sizing without host syncs (branch mega4): tests and the round trip for the
# old (exact) and new (fixed rows in the rerun guard) sizing side by side. One 4-GPU run, < 150 s, after the
# build (STEPS=build bash tools/gpu_suite.sh 4; export PYTHONPATH=/tmp/site); logs in $OUT:
#
#   bash tools/gpu_mega4.sh
#
#   1. tests/test_megatron_layer.py -m gpu: parity with Megatron's alltoall (bf16, kernels), now also inside the
#      rerun guard with a fixed M that fits (no re-run) and one that cannot (128 rows: the step must be re-run
#      exactly, once, and still match).
#   2. tools/profile_round_trip.py: our round trip (yardstick shape) with sizing exact / bound / auto+guard, each
#      with GPU time, host enqueue time, host syncs per steady-state iteration, the yardstick floor at the
#      exact and the fixed row count; torch.profiler table of the guarded variant.
#   3. the yardstick (.out/megatron_layer_bench.py, the lead's copy of shared/tools/megatron_layer_bench.py)
#      with MOE_DISPATCHER_EXPERT_ROWS=exact (the old default) and =bound (fixed rows: what a guarded step
#      runs, without the per-step check; the yardstick calls the layer outside any guard), each against
#      Megatron's alltoall / allgather in the same run. Its "layer fwd+bwd" column shows what fixed M's zero
#      rows cost Megatron's SequentialMLP experts (they compute on them).
#   4. the training driver (configs/tiny_gpu.yaml, 120 steps, default sizing = guarded): loss, tokens/s and
#      how many steps were re-run for an expert-row overflow.
#   5. if time is left: the yardstick with fixed rows at 3% headroom.
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1 MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-120} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/logs"
N=${N:-4}
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1 && [ -z "${PYTHONPATH:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
[ -e moe_dispatcher/integrations ] || ln -s ../integrations moe_dispatcher/integrations  # what the editable install maps
summary="$OUT/summary_mega4.txt"
: > "$summary"
git log --oneline -1 >> "$summary" 2>/dev/null
start=$(date +%s); DEADLINE=${DEADLINE:-145}
run() {  # run NAME LIMIT_S CMD...   (skipped / shortened near the deadline)
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  local left=$(( DEADLINE - (t0 - start) ))
  if (( left < 25 )); then echo "SKIP $name (deadline)" | tee -a "$summary"; return; fi
  (( limit > left )) && limit=$left
  timeout -k 5 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $name ($(( $(date +%s) - t0 )) s)" | tee -a "$summary"
  if ((rc != 0)); then
    grep -E "^E |FAILED|Error|error:|Fatal Python error|Segmentation|exited with code|File \"|case " \
      "$OUT/logs/$name.log" | grep -v "^E  *$" | head -n 30 | sed 's/^/    /' | tee -a "$summary"
  fi
}
run megatron_layer_gpu 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_megatron_layer.py
tail -n 2 "$OUT/logs/megatron_layer_gpu.log" | sed 's/^/    /' | tee -a "$summary"
run round_trip_profile 45 env OUT="$OUT" torchrun --standalone --nproc_per_node "$N" tools/profile_round_trip.py
sed -n '1,/^  guard:/p' "$OUT/round_trip_profile.txt" 2>/dev/null | sed 's/^/    /' | tee -a "$summary"
yardstick() {  # yardstick NAME ENV...: the yardstick (all dispatchers) with our sizing set by ENV
  local name=$1; shift
  if [ ! -f .out/megatron_layer_bench.py ]; then echo "SKIP $name (.out/megatron_layer_bench.py missing)" | tee -a "$summary"; return; fi
  run "$name" 40 env "$@" torchrun --standalone --nproc_per_node "$N" .out/megatron_layer_bench.py
  grep -E "round trip|FAILED" "$OUT/logs/$name.log" | sed 's/^/    /' | tee -a "$summary"
}
# Old default sizing, and fixed rows (what a guarded step runs, less its per-step check; the yardstick calls
# the layer outside any guard). "layer fwd+bwd" shows what the ~10% zero rows of fixed M cost the experts.
yardstick yardstick_rows_exact MOE_DISPATCHER_EXPERT_ROWS=exact
yardstick yardstick_rows_bound MOE_DISPATCHER_EXPERT_ROWS=bound
run train_guarded 40 torchrun --standalone --nproc_per_node "$N" -m moe_dispatcher.integrations.megatron.train \
  --config configs/tiny_gpu.yaml --steps 120 --no-progress --set train.log_interval=40
grep -E "^step|^done" "$OUT/logs/train_guarded.log" | sed 's/^/    /' | tee -a "$summary"
yardstick yardstick_rows_bound_h1.03 MOE_DISPATCHER_EXPERT_ROWS=bound MOE_DISPATCHER_EXPERT_ROWS_HEADROOM=1.03
echo "total $(( $(date +%s) - start )) s" | tee -a "$summary"
