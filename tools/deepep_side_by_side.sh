#!/usr/bin/env bash
# DeepEP V1's own tests (tests/test_intranode.py, tests/test_low_latency.py), unmodified, run twice on one GPU
# machine: against DeepEP V1 itself and against moe_dispatcher (`import deep_ep` made to give moe_dispatcher,
# as `import moe_dispatcher as deep_ep` does for users), then host time per call of both (tools/host_time.py).
#
#   DEEPEP_SRC=.deepep_v1 DEEPEP_SITE=/tmp/deepep_site bash tools/deepep_side_by_side.sh [NUM_GPUS]
#
#   DEEPEP_SRC   DeepEP V1's source tree (its tests/ are run from there); default .deepep_v1
#   DEEPEP_SITE  a folder from which `import deep_ep` gives DeepEP V1, already built (its deep_ep package and
#                deep_ep_cpp extension). This script builds nothing of DeepEP's; without DEEPEP_SITE, or when
#                that import fails, only moe_dispatcher's runs happen and the summary says so.
#   OUT          logs go to $OUT/deepep/ (default /tmp/deepep_out): NAME.log + NAME.rc ("exit_code seconds")
#                for NAME in {intranode,low_latency}_{deepep,ours}, preflight_*.log, host_time.*, summary.md
#   TIMEOUT_INTRANODE, TIMEOUT_LL, TIMEOUT_HOST_TIME   seconds per run (default 150, 150, 120); a run that
#                hangs is killed with its spawned processes (timeout signals its whole process group)
#   DEADLINE_S   seconds for the whole script (default 560): a run that would start with less than 20 s left
#                is skipped, and every run's limit is cut to what is left
#   SKIP         space-separated run names to leave out (e.g. "host_time intranode_deepep")
#   PYTHON       default python
#   MOE_DISPATCHER_BACKEND   default kernels for our side (a call the kernels cannot serve fails, no fallback)
#   NVSHMEM_REMOTE_TRANSPORT default none (one host, no InfiniBand); multicast is off (NVLS, symmetric memory)
#
# moe_dispatcher comes from this checkout; if its extension does not import, it is built first
# (MOE_DISPATCHER_BUILD_EXT=1 pip install --no-deps --no-build-isolation -e ., log in $OUT/deepep).
#
# The arguments: DeepEP's defaults (4096 tokens, H=7168, top-8) except --num-processes NUM_GPUS, and 256
# experts for low latency (its default is 288; 256 is the shape of our benches and targets). test_intranode
# runs its 24 correctness cases then sweeps the NVL chunk at 24 SMs (FP8 dispatch, BF16 dispatch: 16 chunks
# each; combine: 17), 100 calls a point; test_low_latency runs 16 correctness cases, then its bench and two
# profiler passes. Expected on 4 x H100/H200: ~40-70 s per run (process start and NVSHMEM init included),
# 3-5 minutes for the whole script.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
REPO=$(pwd)
N=${1:-4}
PYTHON=${PYTHON:-python}
OUT=${OUT:-/tmp/deepep_out}
LOG=$OUT/deepep
DEEPEP_SRC=$(realpath -m "${DEEPEP_SRC:-.deepep_v1}")
DEEPEP_SITE=${DEEPEP_SITE:-}
DEADLINE_S=${DEADLINE_S:-560}
mkdir -p "$LOG"
start=$(date +%s)
# Multicast off on shared machines; one host without InfiniBand: no remote NVSHMEM transport.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none} PYTHONUNBUFFERED=1
# Our side runs the compiled kernels or fails: no silent fallback to the reference backend.
export MOE_DISPATCHER_BACKEND=${MOE_DISPATCHER_BACKEND:-kernels}

[[ -f "$DEEPEP_SRC/tests/test_intranode.py" && -f "$DEEPEP_SRC/tests/test_low_latency.py" ]] || {
  echo "deepep_side_by_side: no DeepEP tests under DEEPEP_SRC=$DEEPEP_SRC" >&2; exit 2; }
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
(( gpus >= N )) || { echo "deepep_side_by_side: $N GPUs asked, $gpus visible" >&2; exit 2; }

# `import deep_ep` -> moe_dispatcher: the module object itself, exactly what `import moe_dispatcher as deep_ep`
# binds (the import system returns whatever sys.modules holds once the module body has run).
SHIM=$(mktemp -d)/shim
mkdir -p "$SHIM/deep_ep"
cat > "$SHIM/deep_ep/__init__.py" <<'EOF'
import sys

import moe_dispatcher

sys.modules[__name__] = moe_dispatcher
EOF
OURS_PATH=$SHIM:$REPO
DEEPEP_PATH=${DEEPEP_SITE:+$(realpath -m "$DEEPEP_SITE")}

left() { echo $(( DEADLINE_S - ($(date +%s) - start) )); }

# run NAME LIMIT_S CMD...: the command under a time limit, its output in $LOG/NAME.log, "rc seconds" in NAME.rc.
run() {
  local name=$1 limit=$2; shift 2
  if [[ " ${SKIP:-} " == *" $name "* ]]; then echo "SKIP $name (\$SKIP)"; return; fi
  local budget; budget=$(left)
  if (( budget < 20 )); then echo "SKIP $name (deadline)"; return; fi
  (( limit > budget )) && limit=$budget
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  echo "$rc $(( SECONDS - t0 ))" > "$LOG/$name.rc"
  echo "$( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $name ($(( SECONDS - t0 )) s)"
}

# Our extension must import; build it if not.
if ! "$PYTHON" -c "import moe_dispatcher._C" 2>/dev/null; then
  echo "moe_dispatcher._C does not import: building it (log: $LOG/build_moe_dispatcher.log)"
  MOE_DISPATCHER_BUILD_EXT=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PYTHON" -m pip install --no-deps \
    --no-build-isolation -e . > "$LOG/build_moe_dispatcher.log" 2>&1 || echo "FAIL build of moe_dispatcher"
fi

# Which module each side's `import deep_ep` gives (and whether it will run the FP8 cases).
preflight='import deep_ep; print(f"deep_ep={deep_ep.__name__} from {deep_ep.__file__}, "
                                f"is_sm90_compiled={deep_ep.Buffer.is_sm90_compiled()}")'
have_deepep=0
if [[ -n "$DEEPEP_PATH" ]]; then
  PYTHONPATH=$DEEPEP_PATH "$PYTHON" -c "$preflight" > "$LOG/preflight_deepep.log" 2>&1 &&
    grep -q "^deep_ep=deep_ep " "$LOG/preflight_deepep.log" && have_deepep=1
else
  echo "DEEPEP_SITE not set: DeepEP V1 itself is not run" > "$LOG/preflight_deepep.log"
fi
PYTHONPATH=$OURS_PATH "$PYTHON" -c "$preflight" > "$LOG/preflight_ours.log" 2>&1
cat "$LOG/preflight_deepep.log" "$LOG/preflight_ours.log" | tail -n 4

# One port per run: a run killed by its timeout must not leave the next one a port in use.
port=29631
deepep_test() {  # deepep_test NAME PYTHONPATH LIMIT SCRIPT ARGS...
  local name=$1 path=$2 limit=$3; shift 3
  port=$((port + 1))
  run "$name" "$limit" env -C "$DEEPEP_SRC/tests" PYTHONPATH="$path" MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$PYTHON" "$@"
}
intranode_args=(test_intranode.py --num-processes "$N" --num-tokens 4096 --hidden 7168 --num-topk 8
                --num-experts 256)
ll_args=(test_low_latency.py --num-processes "$N" --num-tokens 128 --hidden 7168 --num-topk 8 --num-experts 256)
if (( have_deepep )); then
  deepep_test intranode_deepep "$DEEPEP_PATH" "${TIMEOUT_INTRANODE:-150}" "${intranode_args[@]}"
fi
deepep_test intranode_ours "$OURS_PATH" "${TIMEOUT_INTRANODE:-150}" "${intranode_args[@]}"
if (( have_deepep )); then
  deepep_test low_latency_deepep "$DEEPEP_PATH" "${TIMEOUT_LL:-150}" "${ll_args[@]}"
fi
deepep_test low_latency_ours "$OURS_PATH" "${TIMEOUT_LL:-150}" "${ll_args[@]}"

host_time_args=(--out "$LOG")
(( have_deepep )) && host_time_args+=(--deepep-path "$DEEPEP_PATH")
run host_time "${TIMEOUT_HOST_TIME:-120}" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$N" \
  tools/host_time.py "${host_time_args[@]}"

"$PYTHON" tools/deepep_summary.py "$LOG" "$N x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)" \
  > "$LOG/summary.md"
[[ -f "$LOG/host_time.md" ]] && { echo; sed 's/^# /## /' "$LOG/host_time.md"; } >> "$LOG/summary.md"
cat "$LOG/summary.md"
echo "deepep_side_by_side: $(( $(date +%s) - start )) s"
