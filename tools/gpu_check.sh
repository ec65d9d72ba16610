#!/usr/bin/env bash
# The whole GPU check of this tree on a fresh machine of N GPUs on one host, in one go:
#   1. build the extension (MOE_DISPATCHER_BUILD_EXT=1: fail loudly rather than install pure Python);
#   2. every GPU test family, one pytest per file: intranode, expert-major, low-latency (every world size from 2
#      to N), internode (domains of N/2 and N/4 GPUs, e.g. 2 x 2 and 4 x 1 on 4 GPUs, 2 x 4 and 4 x 2 on 8; on 2 GPUs
#      2 x 1), teardown (a rank SIGKILLed, exit after an error, create/destroy cycles, views after destroy), the peer
#      pool (torch tensors in peer-mapped memory) and the direct dispatch / pull combine over it, cross-rank
#      agreement (disagreeing and refused calls, fresh and cached, every mode), the low-latency host path, the
#      overlap bench's GPU test, the 10,000-call soak (MOE_SOAK_CALLS), Megatron-Core GPU parity and the 200-step
#      training curve;
#   3. the benches beside NCCL: normal mode and low-latency mode at N and at 2 GPUs, internode in domains of N/2;
#   4. the host time of a cached call (tools/host_profile.py);
#   5. extras, cut first by the deadline: the NVLink all-to-all ceiling (tools/nvlink_ceiling.py, needs CuPy), the
#      low-latency phase trace (tools/ll_trace.py) and the Megatron round-trip profile (tools/profile_round_trip.py).
# Each step runs under its own time limit, with its own log; a step that fails or hangs costs only itself.
#
#   bash tools/gpu_check.sh [N]                  N defaults to every visible GPU
#   WHEELS=.whl bash tools/gpu_check.sh 4        first install the wheels in .whl/ (e.g. megatron-core and
#                                                nvshmem4py for Python 3.12) into $SITE (default /tmp/site)
#   SKIP="bench_ll_2 ll_trace" DEADLINE_S=400 bash tools/gpu_check.sh 8
#   DRY=1 bash tools/gpu_check.sh 4              print the steps and their commands, run nothing (no GPU needed)
#
# Settings: OUT (default ./gpu-out), DEADLINE_S (default 560: no step starts, and none runs past, that many
# seconds after the start), SKIP (step names, space-separated; the summary names every step), WHEELS, SITE, DRY.
# Results: $OUT/summary.txt (one line per step: PASS / FAIL rc=... / SKIP, its time, its key log lines) and
# $OUT/gpu-check.tgz (the summary, every step's log, the bench tables .md, records .json and plots .png, the
# tools' outputs). Only those two files are left in $OUT, so a tool that brings back few files gets everything.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

DRY=${DRY:-0}
if [[ -n "${1:-}" ]]; then
  N=$1
elif [[ "$DRY" == 1 ]]; then
  N=4
else
  N=$(nvidia-smi -L | wc -l)
fi
OUT=${OUT:-./gpu-out}
DEADLINE_S=${DEADLINE_S:-560}
SKIP=${SKIP:-}
SITE=${SITE:-/tmp/site}
RUN_DIR="$OUT/gpu-check"          # everything but the summary and the tarball; packed and removed at the end
summary="$OUT/summary.txt"
start=$(date +%s)
mkdir -p "$RUN_DIR/logs"
: > "$summary"

# Every process of every step: NVLink multicast off (NVSHMEM, NCCL and torch's symmetric memory), NVSHMEM on
# this host only, unbuffered Python so a killed step still leaves its log, bounded waits in the tests and the
# library (a hang becomes an error with a message).
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1
export MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-120} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}

# The log lines worth copying into the summary.
KEYS="passed|failed|skipped|FAILED|^E  |Error|GB/s|public cached|public combine|round trip|wrote .*\.md"

say() { echo "$*" | tee -a "$summary"; }

# run NAME LIMIT_S PROGRAM [ARGS...]: one step under `timeout`. `timeout` execs a program, never a shell
# function, so PROGRAM must be an executable (python3, torchrun, env, ...), and a command with arguments is
# passed as separate words (an array), never as one string.
run() {
  local name=$1 limit=$2; shift 2
  if [[ " $SKIP " == *" $name "* ]]; then say "SKIP $name (\$SKIP)"; return; fi
  local left=$(( DEADLINE_S - ($(date +%s) - start) ))
  if (( left < 15 )); then say "SKIP $name (deadline)"; return; fi
  (( limit > left )) && limit=$left
  local log="$RUN_DIR/logs/$name.log" t0; t0=$(date +%s)
  if [[ "$DRY" == 1 ]]; then
    say "DRY  $name (limit ${limit} s): $*"
    return
  fi
  timeout -k 5 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  local verdict="PASS"; (( rc != 0 )) && verdict="FAIL rc=$rc"; (( rc == 124 || rc == 137 )) && verdict+=" (time limit ${limit} s)"
  say "$verdict $name ($(( $(date +%s) - t0 )) s)"
  grep -E "$KEYS" "$log" | head -n 14 | cut -c1-240 | sed 's/^/    /' | tee -a "$summary"
}

say "gpu_check: N=$N, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u '+%Y-%m-%d %H:%M UTC')"
if [[ "$DRY" != 1 ]]; then
  { nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } 2>&1 \
    | tee -a "$summary"
fi

# Wheels the image lacks, into a directory of their own (no index, no dependency resolution: bring each one).
if [[ -n "${WHEELS:-}" ]]; then
  if [[ "$DRY" == 1 ]]; then
    say "DRY  wheels: pip install --no-index --no-deps --target $SITE $WHEELS/*.whl"
  elif python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
       "$WHEELS"/*.whl > "$RUN_DIR/logs/wheels.log" 2>&1; then
    say "PASS wheels ($(ls "$WHEELS"/*.whl | wc -l) from $WHEELS into $SITE)"
  else
    say "FAIL wheels (see logs/wheels.log)"
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

# 1. Build.
run build 240 env MAX_JOBS=${MAX_JOBS:-32} MOE_DISPATCHER_BUILD_EXT=1 \
  python3 -m pip install --no-deps --no-build-isolation -v -e .

# 2. GPU tests, one pytest per file.
PYTEST=(python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short)
run test_intranode 110 "${PYTEST[@]}" tests/kernels/test_intranode_gpu.py
run test_expert_major 90 "${PYTEST[@]}" tests/kernels/test_expert_major_gpu.py
run test_low_latency 120 "${PYTEST[@]}" -s tests/kernels/test_low_latency_gpu.py
run test_ll_agreement 240 "${PYTEST[@]}" -s tests/kernels/test_ll_agreement_gpu.py
if (( N >= 4 )); then
  run test_internode 90 "${PYTEST[@]}" -x -s tests/kernels/test_internode_gpu.py -k "$N-nvl$((N / 2)) or $N-nvl$((N / 4))"
else
  run test_internode 90 "${PYTEST[@]}" -x -s tests/kernels/test_internode_gpu.py -k "2-nvl1"
fi
run test_kernel_names 60 "${PYTEST[@]}" tests/kernels/test_kernel_names.py tests/kernels/test_event_handle.py
run test_teardown_faults 240 "${PYTEST[@]}" -s tests/kernels/test_teardown_gpu.py -k "sigkill or clean_error"
run test_teardown 150 "${PYTEST[@]}" -s tests/kernels/test_teardown_gpu.py -k "cycles or views"
run test_peer_pool 150 "${PYTEST[@]}" -s tests/kernels/test_peer_pool_gpu.py
run test_creation_failure 90 "${PYTEST[@]}" -s tests/kernels/test_creation_failure_gpu.py
run test_direct_dispatch 200 "${PYTEST[@]}" -s tests/kernels/test_direct_dispatch_gpu.py
run test_internode_direct 200 "${PYTEST[@]}" -s tests/kernels/test_internode_direct_gpu.py
run test_cached_host_path 90 "${PYTEST[@]}" -s tests/kernels/test_cached_host_path_gpu.py
run test_agreement 240 "${PYTEST[@]}" -s tests/kernels/test_agreement_gpu.py tests/kernels/test_cached_agreement_gpu.py \
  tests/kernels/test_refused_calls_gpu.py tests/kernels/test_internode_cached_agreement_gpu.py
run test_ll_host_path 90 "${PYTEST[@]}" -s tests/kernels/test_low_latency_host_path_gpu.py
run test_overlap 90 "${PYTEST[@]}" -s tests/kernels/test_overlap_gpu.py
run test_soak 240 "${PYTEST[@]}" -s tests/kernels/test_teardown_gpu.py -k soak
run test_reference_nccl 60 "${PYTEST[@]}" tests/reference
run test_megatron_layer 60 "${PYTEST[@]}" tests/megatron/test_megatron_layer.py
run test_megatron_train 100 "${PYTEST[@]}" tests/megatron/test_megatron_train.py

# 3. Benches, each case beside NCCL in the same run.
BENCH=(python3 -m moe_dispatcher.bench --out-dir "$RUN_DIR/bench")
run bench_normal_$N 90 "${BENCH[@]}" --mode normal --backend kernels --num-ranks "$N" --num-sms 8,16,20,22,24 --plot-sweep
(( N > 2 )) && run bench_normal_2 40 "${BENCH[@]}" --mode normal --backend kernels --num-ranks 2 --num-sms 16,20,24
run bench_ll_$N 40 "${BENCH[@]}" --mode low-latency --num-ranks "$N"
(( N > 2 )) && run bench_ll_2 40 "${BENCH[@]}" --mode low-latency --num-ranks 2
run bench_internode 60 "${BENCH[@]}" --mode internode --backend kernels --num-ranks "$N" --nvl-size $((N / 2))

# 4. Host time of a cached call.
run host_profile 40 torchrun --standalone --nproc_per_node 2 tools/host_profile.py "$RUN_DIR/host_profile"

# 5. Extras.
if [[ "$DRY" == 1 ]] || python3 -c "import cupy" > /dev/null 2>&1; then
  run nvlink_ceiling 40 python3 tools/nvlink_ceiling.py
else
  say "SKIP nvlink_ceiling (needs CuPy)"
fi
run ll_trace 40 torchrun --standalone --nproc_per_node "$N" tools/ll_trace.py --modes graph,graph_dd --out "$RUN_DIR/ll_trace"
run round_trip_profile 80 env OUT="$RUN_DIR/round_trip" torchrun --standalone --nproc_per_node "$N" tools/profile_round_trip.py

say "total $(( $(date +%s) - start )) s"
cp "$summary" "$RUN_DIR/"
tar czf "$OUT/gpu-check.tgz" -C "$OUT" --exclude='*.pt' gpu-check && rm -rf "$RUN_DIR"
echo "results: $summary and $OUT/gpu-check.tgz"
