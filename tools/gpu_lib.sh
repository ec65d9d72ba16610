# Shared by the GPU scripts (sourced): steps under a time limit and a deadline, each with its own log in
# $OUT/logs and one line (plus the log's key lines) in $summary.
#   start=$(date +%s); DEADLINE_S=...; summary=...; source tools/gpu_lib.sh; run NAME LIMIT_S CMD...
# KEYS (grep -E pattern) picks the log lines copied to the summary (default: the last 4 lines); SKIP (names,
# space-separated) leaves steps out.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1

left() { echo $(( DEADLINE_S - ($(date +%s) - start) )); }

run() {
  local name=$1 limit=$2; shift 2
  [[ " ${SKIP:-} " == *" $name "* ]] && { echo "SKIP $name (\$SKIP)" | tee -a "$summary"; return; }
  local budget; budget=$(left)
  (( budget < 15 )) && { echo "SKIP $name (deadline)" | tee -a "$summary"; return; }
  (( limit > budget )) && limit=$budget
  local t0; t0=$(date +%s)
  mkdir -p "$OUT/logs"
  timeout -k 5 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $name ($(( $(date +%s) - t0 )) s)" | tee -a "$summary"
  if [ -n "${KEYS:-}" ]; then
    grep -E "$KEYS" "$OUT/logs/$name.log" | head -n 14 | cut -c1-240 | sed 's/^/    /' | tee -a "$summary"
  else
    tail -n 4 "$OUT/logs/$name.log" | sed 's/^/    /' | tee -a "$summary"
  fi
}
