#!/usr/bin/env bash
# Internode (two-hop) GPU check on the 4-GPU machine, after the build of tools/gpu_suite.sh
# (STEPS="build" bash tools/gpu_suite.sh 4, or include "build" in STEPS here). Under 4 minutes (tests stop at the first failure):
#   tests at MOE_DISPATCHER_NVL_SIZE=2 (2 emulated domains of 2) and =1 (4 domains of 1),
#   bench --mode internode --nvl-size 2 (intranode kernels and NCCL beside it, same run).
# Logs in $OUT/logs, summary in $OUT/summary_internode.txt, everything packed into $OUT/internode.tgz.
#   bash tools/gpu_internode.sh            STEPS="build tests bench" bash tools/gpu_internode.sh
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1 MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-75} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/logs"
STEPS=${STEPS:-"tests bench"}
DEADLINE_S=${DEADLINE_S:-230}
start=$(date +%s)
summary="$OUT/summary_internode.txt"
: > "$summary"
left() { echo $(( DEADLINE_S - ($(date +%s) - start) )); }
run() {
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  (( budget < 10 )) && { echo "SKIP $name (deadline)" | tee -a "$summary"; return; }
  (( limit > budget )) && limit=$budget
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $name ($(( $(date +%s) - t0 )) s)" | tee -a "$summary"
  tail -n 6 "$OUT/logs/$name.log" | sed 's/^/    /' | tee -a "$summary"
  (( rc == 0 )) || failed=1
}
failed=0
# FAIL_FAST=1: a failed test step skips the later steps (tools/gpu_inter_clean.sh sets it).
stop_early() { [[ "${FAIL_FAST:-0}" == 1 && $failed == 1 ]] && { echo "SKIP the rest (FAIL_FAST)" | tee -a "$summary"; return 0; }; return 1; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
has build && { DEADLINE_S=$((DEADLINE_S + 240)); run build 240 env MAX_JOBS=32 MOE_DISPATCHER_BUILD_EXT=1 python3 -m pip install --no-deps --no-build-isolation -v -e .; }
if has tests && ! stop_early; then
  run internode_tests_nvl2 80 python3 -m pytest -x -q -s -m gpu -p no:cacheprovider tests/test_internode_gpu.py -k "4-nvl2"
  stop_early || run internode_tests_nvl1 80 python3 -m pytest -x -q -s -m gpu -p no:cacheprovider tests/test_internode_gpu.py -k "4-nvl1"
fi
has bench && ! stop_early && run bench_internode_4 75 python3 -m moe_dispatcher.bench --mode internode --nvl-size 2 --backend kernels --num-ranks 4 --out-dir "$OUT"
echo "total $(( $(date +%s) - start )) s" >> "$summary"
tar czf "$OUT/internode.tgz" -C "$OUT" --exclude internode.tgz --exclude results.tgz . 2>/dev/null
cat "$summary"
