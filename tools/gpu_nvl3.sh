#!/usr/bin/env bash
# Intranode ring protocols, old (chunked) vs new (stream, tma), on the 4-GPU machine, after the build of
# tools/gpu_suite.sh (STEPS=build bash tools/gpu_suite.sh 4; export PYTHONPATH=/tmp/site). About 5-6 minutes,
# highest priority first, each step under its own time limit, stopping before DEADLINE_S:
#   1. tests/test_intranode_gpu.py (2 and 4 ranks; every case under each protocol, mixed within a case, the
#      protocol switching inside the 1000-call loop, CUDA graphs and timeouts of each), not the speed report
#      nor the create/destroy leak check (buffers are unchanged), the timeout test at 4 ranks only;
#   2. bench normal mode, 4 ranks: every config timed with each protocol (--nvl-variants chunked,stream, then
#      tma in a process of its own) beside NCCL: num_sms 8/16/20/24 with the tuned chunks, send:recv chunks at
#      24 SMs, a few at 8 and 16 SMs;
#   3. tests/test_expert_major_gpu.py at 4 ranks (cases alternate protocol and split/fused combine);
#   4. the bench on 2 ranks (fewer rows).
# Logs in $OUT/logs, bench JSON/markdown in $OUT, summary in $OUT/summary_nvl3.txt (printed at the end):
# per op and SM count the best logical GB/s of each protocol (its chunks), NCCL's and the target.
# Protocols: MOE_DISPATCHER_NVL_VARIANT (docs/intranode.md); the default stays chunked until these figures.
#   bash tools/gpu_nvl3.sh            STEPS="bench4 bench2" bash tools/gpu_nvl3.sh
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1 MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-100} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/logs"
STEPS=${STEPS:-"tests bench4 bench2 em"}
DEADLINE_S=${DEADLINE_S:-420}
start=$(date +%s)
summary="$OUT/summary_nvl3.txt"
: > "$summary"
left() { echo $(( DEADLINE_S - ($(date +%s) - start) )); }
run() {
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  (( budget < 15 )) && { echo "SKIP $name (deadline)" | tee -a "$summary"; return; }
  (( limit > budget )) && limit=$budget
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $name ($(( $(date +%s) - t0 )) s)" | tee -a "$summary"
  tail -n 4 "$OUT/logs/$name.log" | sed 's/^/    /' | tee -a "$summary"
}
has() { [[ " $STEPS " == *" $1 "* ]]; }
bench() {  # bench NAME RANKS VARIANTS ARGS...: normal mode, JSON to $OUT/NAME.json
  local name=$1 ranks=$2 variants=$3; shift 3
  run "$name" 100 python3 -m moe_dispatcher.bench --mode normal --backend kernels --num-ranks "$ranks" \
    --nvl-variants "$variants" --json "$OUT/$name.json" --out-dir "$OUT" "$@"
}
ROWS4="--num-sms 8,16,20,24 --chunks 4:256,8:256,24:256,32:256,12:512,32:512 --configs 8:32:256,8:12:512,16:32:256,16:12:512"
ROWS2="--num-sms 8,16,24 --chunks 8:256,32:256,32:512"

# The bulk-copy protocol (tma) runs in worlds and bench processes of its own: a fault there (e.g. bulk stores
# to CUDA-IPC peer memory refused) leaves the others' results.
has tests && run tests_intranode 170 python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfE --tb=short \
  tests/test_intranode_gpu.py -k "not speed and not leak" \
  --deselect "tests/test_intranode_gpu.py::test_timeout_names_rank_and_phase[2]"
# shellcheck disable=SC2086
has bench4 && bench bench_nvl3_4 4 chunked,stream $ROWS4
# shellcheck disable=SC2086
has bench4 && bench bench_nvl3_4_tma 4 tma $ROWS4
has em && run tests_expert_major 100 python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfE --tb=short \
  tests/test_expert_major_gpu.py -k 4
# shellcheck disable=SC2086
has bench2 && bench bench_nvl3_2 2 chunked,stream $ROWS2
# shellcheck disable=SC2086
has bench2 && bench bench_nvl3_2_tma 2 tma $ROWS2

python3 - "$OUT" >> "$summary" 2>&1 <<'EOF'
import json, os, sys
out = sys.argv[1]
for ranks in (4, 2):
    recs = []
    for name in (f"bench_nvl3_{ranks}", f"bench_nvl3_{ranks}_tma"):
        path = os.path.join(out, name + ".json")
        if os.path.exists(path):
            recs += json.load(open(path))["records"]
        else:
            print(f"R={ranks}: no {name}.json")
    if not recs:
        continue
    nccl = {r["op"].split()[-1]: r["logical_gbps"]["mean"] for r in recs if r.get("section") == "nccl"}
    best = {}
    for r in recs:
        if r.get("section") != "normal":
            continue
        key = (f"{r['op']} {r['dtype']}", r["num_sms"], r.get("nvl_variant", "-"))
        if key not in best or r["logical_gbps"]["mean"] > best[key]["logical_gbps"]["mean"]:
            best[key] = r
    print(f"R={ranks}: logical GB/s (best chunks s/r), NCCL all_to_all of the same rows: "
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(nccl.items())))
    ops = sorted({k[0] for k in best})
    variants = sorted({k[2] for k in best})
    for op in ops:
        for sms in sorted({k[1] for k in best if k[0] == op}):
            cells = []
            for v in variants:
                r = best.get((op, sms, v))
                cells.append(f"{v} {r['logical_gbps']['mean']:6.1f} ({r['t_us']['mean']:6.1f} us, "
                             f"{r['send_chunk']}/{r['recv_chunk']})" if r else f"{v} -")
            tgt = next((r.get("target_gbps") for k, r in best.items() if k[0] == op), None)
            print(f"  {op:13s} {sms:2d} SMs: " + " | ".join(cells) + (f" | target {tgt}" if tgt else ""))
EOF
echo "total $(( $(date +%s) - start )) s" >> "$summary"
cat "$summary"
