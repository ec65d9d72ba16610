#!/usr/bin/env bash
# Host time of repeated cached calls (issue 3: "a cached dispatch call costs < 15 us of host time") with the
# fast path of branch host15: a repeated cached dispatch/combine whose handle plan matches launches the plan
# (csrc/intranode_bindings.cpp DispatchPlan/CombinePlan) with its stream joins in one native call. On the
# 4-GPU machine after the build (STEPS=build bash tools/gpu_suite.sh 4; PYTHONPATH=/tmp/site), ~150 s:
#
#   bash tools/gpu_host15.sh
#
#   1. tools/host_profile.py at 2 ranks (T=128, H=7168): public cached dispatch / combine on the fast path and
#      on the full path (Buffer.fast_cached_calls = False, as MOE_DISPATCHER_FAST_CACHED=0 sets it) side by
#      side, the bare launches (old 25-argument launcher, the plan with and without stream joins), a cProfile;
#   2. tools/host_glue_cpu.py: the Python glue alone on this host's CPU (stub extension, CPU tensors);
#   3. tests/test_intranode_gpu.py at 2 and 4 ranks (every case against the reference; the new
#      test_fast_path_of_repeated_cached_calls: fast path = full path = reference, FP8, async_finish with the
#      inputs dropped before the event, previous_event / allocate_on_comm_stream / a side stream, a CUDA graph).
# Logs in $OUT/logs, summary in $OUT/summary_host15.txt (printed at the end).
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1 MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-120} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/logs"
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1 && [ -z "${PYTHONPATH:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
summary="$OUT/summary_host15.txt"
: > "$summary"
start=$(date +%s)
run() {  # run NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $name ($(( $(date +%s) - t0 )) s)" | tee -a "$summary"
  if ((rc != 0)); then
    grep -E "^E |FAILED|Error|error:|Fatal Python error|Segmentation|exited with code|File \"" \
      "$OUT/logs/$name.log" | grep -v "^E  *$" | head -n 30 | sed 's/^/    /' | tee -a "$summary"
  fi
}
run host_profile_2 60 torchrun --standalone --nproc_per_node 2 tools/host_profile.py "$OUT"
sed -n '1,/^$/p' "$OUT/host_profile.txt" 2>/dev/null | sed 's/^/    /' >> "$summary"
run host_glue_cpu 40 python3 tools/host_glue_cpu.py --calls 5000
grep -E " us " "$OUT/logs/host_glue_cpu.log" | sed 's/^/    /' >> "$summary"
run gpu_test_intranode 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/test_intranode_gpu.py
tail -n 3 "$OUT/logs/gpu_test_intranode.log" | sed 's/^/    /' >> "$summary"
echo "total $(( $(date +%s) - start )) s" >> "$summary"
cat "$summary"
