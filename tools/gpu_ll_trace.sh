#!/usr/bin/env bash
# Low-latency phase trace on a lent 4-GPU machine, after the build:
#
#   STEPS=build bash tools/gpu_suite.sh 4 > /dev/null 2>&1; bash tools/gpu_ll_trace.sh
#
# Steps, highest priority first, each with its own log in $OUT/ll_trace_logs/, one line each in
# $OUT/ll_trace_summary.txt; a step that would pass DEADLINE_S (default 175) is cut or skipped:
#   tests_4gpu        tests/test_low_latency_gpu.py at 4 GPUs, trace OFF (the kernels with the trace points but a
#                     null trace pointer: bit-exact results, and the timing line to compare with earlier runs)
#   trace_4gpu        tools/ll_trace.py at 4 GPUs (eager d+c, graph d+c, graph d+d; E=256 FP8, the bench's shape)
#   trace_2gpu        the same at 2 GPUs
#   cases_2gpu_traced the correctness cases at 2 GPUs with MOE_DISPATCHER_LL_TRACE=1 (tracing changes no result)
# The trace reports land in $OUT/ll_trace_{4,2}gpu.txt (raw records: .pt) and are copied into the summary.
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1 MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-120} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}
export OUT=${OUT:-./gpu-out}
unset MOE_DISPATCHER_LL_TRACE  # off unless a step sets it
mkdir -p "$OUT/ll_trace_logs"
DEADLINE_S=${DEADLINE_S:-175}
CALLS=${CALLS:-30}
GPUS=$(nvidia-smi -L | wc -l)
start=$(date +%s)
summary="$OUT/ll_trace_summary.txt"
: > "$summary"

# Wheels the image lacks (nvshmem4py), as gpu_suite.sh installs them.
if [ -d /tmp/site ]; then
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
elif [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi

left() { echo $(( DEADLINE_S - ($(date +%s) - start) )); }
# step NAME LIMIT_S CMD...: log in $OUT/ll_trace_logs/NAME.log, PASS/FAIL line + the log's key lines in the summary.
step() {
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  (( budget < 20 )) && { echo "SKIP $name (deadline)" | tee -a "$summary"; return; }
  (( limit > budget )) && limit=$budget
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" bash -c "$(declare -f tests); \"\$@\"" _ "$@" > "$OUT/ll_trace_logs/$name.log" 2>&1
  local rc=$?
  echo "$( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $name ($(( $(date +%s) - t0 )) s)" | tee -a "$summary"
  grep -E "passed|failed|[Ee]rror|Traceback|low-latency [0-9]+ GPUs" "$OUT/ll_trace_logs/$name.log" | tail -n 12 \
    | sed 's/^/    /' | tee -a "$summary"
}
# tests N [pytest args]: the low-latency GPU tests of world size N only.
tests() {
  local n=$1; shift
  local ids
  ids=$(python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider tests/test_low_latency_gpu.py "$@" 2>/dev/null \
        | grep -E "::.*\[([^]]*-)?$n(-[^]]*)?\]$")
  [ -n "$ids" ] || { echo "no tests collected for $n GPUs" >&2; return 1; }
  python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfE --tb=short $ids
}

{ nvidia-smi -L; git log --oneline -1; } >> "$summary" 2>&1
if (( GPUS >= 4 )); then
  step tests_4gpu 80 tests 4
  step trace_4gpu 45 torchrun --standalone --nproc_per_node 4 tools/ll_trace.py --calls "$CALLS" --out "$OUT"
else
  echo "SKIP 4-GPU steps (only $GPUS visible)" | tee -a "$summary"
fi
step trace_2gpu 35 torchrun --standalone --nproc_per_node 2 tools/ll_trace.py --calls "$CALLS" --out "$OUT"
step cases_2gpu_traced 40 env MOE_DISPATCHER_LL_TRACE=1 bash -c "$(declare -f tests); tests 2 -k cases"
for n in 4 2; do
  [ -f "$OUT/ll_trace_${n}gpu.txt" ] && { echo; cat "$OUT/ll_trace_${n}gpu.txt"; } >> "$summary"
done
echo "total $(( $(date +%s) - start )) s" | tee -a "$summary"
