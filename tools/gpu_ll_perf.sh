#!/usr/bin/env bash
# Low-latency kernels on one lent GPU machine, after the build (tools/gpu_suite.sh builds): the GPU tests of
# tests/test_low_latency_gpu.py and the low-latency bench (E=256 and 32), at 4 and 2 GPUs, for every kernel
# variant (MOE_DISPATCHER_LL_VARIANT bits; the bench times them side by side in one run with --ll-variants).
# Highest priority first; a step that would pass DEADLINE_S (default 235) is skipped. Logs and the bench
# records land in $OUT (default ./gpu-out): $OUT/ll_logs/*.log, $OUT/ll_summary.txt, bench_*.{md,json}.
#
#   bash tools/gpu_ll_perf.sh              VARIANTS="0 1" by default
#   VARIANTS="0" DEADLINE_S=120 bash tools/gpu_ll_perf.sh
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1 MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-120} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}
export OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/ll_logs"
VARIANTS=${VARIANTS:-"0 1"}
DEADLINE_S=${DEADLINE_S:-235}
GPUS=$(nvidia-smi -L | wc -l)
start=$(date +%s)
summary="$OUT/ll_summary.txt"
: > "$summary"
export variant_list=$(echo $VARIANTS | tr ' ' ',')
first_variant=${VARIANTS%% *}

# Wheels the image lacks (nvshmem4py), as gpu_suite.sh installs them.
if [ -d /tmp/site ]; then
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
elif [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi

left() { echo $(( DEADLINE_S - ($(date +%s) - start) )); }
# step NAME LIMIT_S CMD...: its log in $OUT/ll_logs/NAME.log, a line (and the log's tail) in the summary.
step() {
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  (( budget < 20 )) && { echo "SKIP $name (deadline)" | tee -a "$summary"; return; }
  (( limit > budget )) && limit=$budget
  local t0; t0=$(date +%s)
  # tests/bench are shell functions: run them in a child bash that has their definitions.
  timeout -k 5 "$limit" bash -c "$(declare -f tests bench); \"\$@\"" _ "$@" > "$OUT/ll_logs/$name.log" 2>&1
  local rc=$?
  echo "$( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $name ($(( $(date +%s) - t0 )) s)" | tee -a "$summary"
  grep -E "^\[low-latency\]|passed|failed|error|low-latency [0-9]+ GPUs" "$OUT/ll_logs/$name.log" | tail -n 40 \
    | sed 's/^/    /' | tee -a "$summary"
}
# tests N VARIANT [-k EXPR]: the low-latency GPU tests of world size N only.
tests() {
  local n=$1 v=$2; shift 2
  local ids
  ids=$(python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider tests/test_low_latency_gpu.py "$@" 2>/dev/null \
        | grep -E "::.*\[([^]]*-)?$n(-[^]]*)?\]$")
  [ -n "$ids" ] || { echo "no tests collected for $n GPUs" >&2; return 1; }
  MOE_DISPATCHER_LL_VARIANT=$v python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfE --tb=short $ids
}
bench() {
  python3 -m moe_dispatcher.bench --mode low-latency --backend kernels --num-ranks "$1" --ll-experts 256,32 \
    --ll-variants "$variant_list" --out-dir "$OUT"
}

{ nvidia-smi -L; git log --oneline -1; echo "variants: $VARIANTS"; } >> "$summary" 2>&1
for n in 4 2; do
  (( n > GPUS )) && { echo "SKIP $n GPUs (only $GPUS visible)" | tee -a "$summary"; continue; }
  limit_t=75; limit_b=70; limit_v=50
  (( n == 2 )) && { limit_t=55; limit_b=50; limit_v=40; }
  # Bit-exactness first (tests with the first variant: cases, 1000-call loop + graphs, switch, timing).
  step "tests_${n}gpu_v${first_variant}" $limit_t tests "$n" "$first_variant"
  step "bench_ll_${n}gpu" $limit_b bench "$n"
  for v in $VARIANTS; do
    [ "$v" = "$first_variant" ] && continue
    step "tests_${n}gpu_v${v}" $limit_v tests "$n" "$v" -k "cases or loop"
  done
done
echo "total $(( $(date +%s) - start )) s" | tee -a "$summary"
