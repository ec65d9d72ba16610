#!/usr/bin/env bash
# Everything one session's kernel changes need, in one call on the 4-GPU machine (under ~9 minutes):
# build, the internode script (tests at nvl 2 and 1, bench), the fused expert-major script (tests, Megatron
# parity, yardstick, round-trip profile), the intranode kernel tests, the Megatron training-curve test and
# the host-overhead profile. Everything lands in $OUT/session.tgz plus $OUT/session_summary.txt.
set -u
export OUT=${OUT:-./gpu-out}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
mkdir -p "$OUT"
S="$OUT/session_summary.txt"
# Packed after every stage, so a call cut short still brings back what finished.
pack() { tar czf "$OUT/session.tgz" -C "$OUT" --exclude session.tgz --exclude results.tgz --exclude internode.tgz . 2>/dev/null; }
STEPS=build bash tools/gpu_suite.sh 4 > /dev/null 2>&1
grep -E "PASS|FAIL" "$OUT/summary.txt" > "$S"
export PYTHONPATH=/tmp/site
DEADLINE_S=${INTERNODE_S:-180} bash tools/gpu_internode.sh > /dev/null 2>&1; cat "$OUT/summary_internode.txt" >> "$S"; pack
bash tools/gpu_fused.sh > /dev/null 2>&1; cat "$OUT/fused_summary.txt" >> "$S"; pack
TESTS="tests/test_intranode_gpu.py tests/test_megatron_train.py" TEST_LIMIT_S=${TEST_LIMIT_S:-80} STEPS=tests \
  DEADLINE_S=170 bash tools/gpu_suite.sh 4 > /dev/null 2>&1
grep -v "^GPU\|^torch" "$OUT/summary.txt" >> "$S"; pack
timeout 60 torchrun --standalone --nproc_per_node 2 tools/host_profile.py "$OUT" > "$OUT/logs/host_profile.log" 2>&1
head -8 "$OUT/host_profile.txt" >> "$S" 2>/dev/null
pack
cat "$S"
