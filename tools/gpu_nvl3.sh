#!/usr/bin/env bash
# Intranode ring protocols, old (chunked) vs new (stream, tma), on the 4-GPU machine, after the build of
# tools/gpu_suite.sh (STEPS=build bash tools/gpu_suite.sh 4; export PYTHONPATH=/tmp/site). About 4-5 minutes,
# highest priority first, each step under its own time limit, stopping before DEADLINE_S:
#   1. tests/test_intranode_gpu.py (2 and 4 ranks; every case under each protocol, mixed within a case, the
#      protocol switching inside the 1000-call loop, CUDA graphs and timeouts of each), not the speed report
#      nor the create/destroy leak check (buffers are unchanged);
#   2. bench normal mode, 4 ranks: every config timed with each protocol (--nvl-variants chunked,stream,tma) beside
#      NCCL: num_sms 8/16/20/24 with the tuned chunks, send:recv chunks at 24 SMs, a few at 8 and 16 SMs;
#   3. tests/test_expert_major_gpu.py (cases alternate protocol and split/fused combine);
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
DEADLINE_S=${DEADLINE_S:-330}
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
bench() {  # bench NAME RANKS ARGS...: normal mode, both protocols, JSON to $OUT/NAME.json
  local name=$1 ranks=$2; shift 2
  run "$name" 120 python3 -m moe_dispatcher.bench --mode normal --backend kernels --num-ranks "$ranks" \
    --nvl-variants chunked,stream,tma --json "$OUT/$name.json" --out-dir "$OUT" "$@"
}

has tests && run tests_intranode 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfE --tb=short \
  tests/test_intranode_gpu.py -k "not speed and not leak"
has bench4 && bench bench_nvl3_4 4 --num-sms 8,16,20,24 --chunks 4:256,8:256,24:256,32:256,12:512,32:512 \
  --configs 8:32:256,8:12:512,16:32:256,16:12:512
has em && run tests_expert_major 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfE --tb=short \
  tests/test_expert_major_gpu.py
has bench2 && bench bench_nvl3_2 2 --num-sms 8,16,24 --chunks 8:256,16:256,32:256,32:512

python3 - "$OUT" >> "$summary" 2>&1 <<'EOF'
import json, os, sys
out = sys.argv[1]
for ranks in (4, 2):
    path = os.path.join(out, f"bench_nvl3_{ranks}.json")
    if not os.path.exists(path):
        print(f"R={ranks}: no bench JSON")
        continue
    recs = json.load(open(path))
    recs = recs.get("records", recs) if isinstance(recs, dict) else recs
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
