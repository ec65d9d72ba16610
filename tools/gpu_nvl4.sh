#!/usr/bin/env bash
# Intranode ring protocols after the tma protocol's removal: chunked and stream, and the stream protocol's
# knobs (MOE_DISPATCHER_NVL_VARIANT suffixes, docs/intranode.md: w<N> copy warps per ring, u spread, p shared
# poll, b<N> release batch, h halves, e evict-first ring reads, a 128-byte slots) and smaller rings, swept on
# the 4-GPU machine to find why stream gets slower from 20 to 24 SMs on 4 ranks. After the build of tools/gpu_suite.sh (STEPS=build bash tools/gpu_suite.sh 4;
# export PYTHONPATH=/tmp/site). About 150 s, highest priority first, each step under its own time limit,
# stopping before DEADLINE_S:
#   1. tests/test_intranode_gpu.py at 4 ranks: every case under chunked and stream, then under two knob
#      variants (every knob on; 3 copy warps per ring), CUDA graphs, 1000 back-to-back calls switching
#      protocol, the fast path, timeouts of all four (not the speed report nor the leak check);
#   2. tests/test_expert_major_gpu.py at 4 ranks (split and fused dispatch; cases alternate chunked / stream,
#      the last ones and the graph case take the knob variants);
#   3. bench normal mode, 4 ranks, num_sms 16/20/22/24 (tuned chunks), every variant beside NCCL, in two
#      processes (single knobs, then combinations: a knob that breaks the Buffer costs only its own half);
#   4. bench on 2 ranks at 24 SMs (a few variants).
# Logs in $OUT/logs, bench JSON/markdown in $OUT, summary in $OUT/summary_nvl4.txt (printed at the end): per
# op, rank count and variant, the logical GB/s (best chunks) at each SM count, NCCL's and the target.
#   bash tools/gpu_nvl4.sh            STEPS="bench4a bench4b" bash tools/gpu_nvl4.sh
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1 MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-100} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/logs"
STEPS=${STEPS:-"tests em bench4a bench4b bench2"}
DEADLINE_S=${DEADLINE_S:-175}
start=$(date +%s)
summary="$OUT/summary_nvl4.txt"
: > "$summary"
left() { echo $(( DEADLINE_S - ($(date +%s) - start) )); }
run() {  # run NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  (( budget < 15 )) && { echo "SKIP $name (deadline)" | tee -a "$summary"; return; }
  (( limit > budget )) && limit=$budget
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $name ($(( $(date +%s) - t0 )) s)" | tee -a "$summary"
  if ((rc != 0)); then
    grep -E "^E |FAILED|Error|error:|Fatal Python error|Segmentation|exited with code|case |failed:" \
      "$OUT/logs/$name.log" | grep -v "^E  *$" | head -n 30 | sed 's/^/    /' | tee -a "$summary"
  else
    tail -n 3 "$OUT/logs/$name.log" | sed 's/^/    /' | tee -a "$summary"
  fi
}
has() { [[ " $STEPS " == *" $1 "* ]]; }
bench() {  # bench NAME RANKS VARIANTS ARGS...: normal mode, JSON to $OUT/NAME.json
  local name=$1 ranks=$2 variants=$3; shift 3
  run "$name" 60 python3 -m moe_dispatcher.bench --mode normal --backend kernels --num-ranks "$ranks" \
    --nvl-variants "$variants" --json "$OUT/$name.json" --out-dir "$OUT" "$@"
}
PYTEST=(python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfE --tb=short)
# Single knobs beside both protocols as they are, then combinations.
V4A="chunked,stream,stream/a,stream/e,stream/h,stream/u,stream/w5,stream/w4"
V4B="stream/p,stream/b8,stream/b8/p,stream/e/p,stream/a/b8/e/h/p/u,stream/b8/e/p/w5"
V2="chunked,stream,stream/p,stream/a/b8/e/h/p/u"

has tests && run tests_intranode 100 "${PYTEST[@]}" \
  "tests/test_intranode_gpu.py::test_matches_reference[chunked+stream-4]" \
  "tests/test_intranode_gpu.py::test_matches_reference[knobs-4]" \
  "tests/test_intranode_gpu.py::test_graph_and_back_to_back[chunked+stream-4]" \
  "tests/test_intranode_gpu.py::test_graph_and_back_to_back[knobs-4]" \
  "tests/test_intranode_gpu.py::test_fast_path_of_repeated_cached_calls[4]" \
  "tests/test_intranode_gpu.py::test_timeout_names_rank_and_phase[4]"
has em && run tests_expert_major 70 "${PYTEST[@]}" "tests/test_expert_major_gpu.py::test_fused_expert_major_matches[4]"
# Rows: tuned chunks (rings of 256 slots) at each SM count, and smaller rings at 20 and 24 SMs (64, 128 slots;
# 32 at 24 SMs, dispatch only: combine needs send chunk + 32): if deep rings overflow L2 once the senders
# outrun the receivers (the 24-SM drop), small rings recover it.
ROWS4=(--num-sms 16,20,22,24 --chunks 12:32,12:64,12:128 --configs 20:12:64,20:12:128)
has bench4a && bench bench_nvl4_4a 4 "$V4A" "${ROWS4[@]}"
has bench4b && bench bench_nvl4_4b 4 "$V4B" "${ROWS4[@]}"
has bench2 && bench bench_nvl4_2 2 "$V2" --num-sms 24 --chunks 12:128

python3 - "$OUT" >> "$summary" 2>&1 <<'EOF'
import json, os, sys
out = sys.argv[1]
for ranks, names in ((4, ("bench_nvl4_4a", "bench_nvl4_4b")), (2, ("bench_nvl4_2",))):
    recs = []
    for name in names:
        path = os.path.join(out, name + ".json")
        if os.path.exists(path):
            recs += json.load(open(path))["records"]
        else:
            print(f"R={ranks}: no {name}.json")
    if not recs:
        continue
    nccl = {r["op"].split()[-1]: r["logical_gbps"]["mean"] for r in recs if r.get("section") == "nccl"}
    best, order = {}, []
    for r in recs:
        if r.get("section") != "normal":
            continue
        v = r.get("nvl_variant", "-")
        if v not in order:
            order.append(v)
        key = (f"{r['op']} {r['dtype']}", (r["num_sms"], r["recv_chunk"]), v)
        if key not in best or r["logical_gbps"]["mean"] > best[key]["logical_gbps"]["mean"]:
            best[key] = r
    ops = sorted({k[0] for k in best})
    sms = sorted({k[1] for k in best})
    print(f"R={ranks}: logical GB/s per num_sms/ring slots (best send chunk), NCCL all_to_all of the same rows: "
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(nccl.items())))
    for op in ops:
        tgt = next((r.get("target_gbps") for k, r in best.items() if k[0] == op and r.get("target_gbps")), None)
        print(f"  {op:14s} target {tgt}   " + "".join(f"{f'{s[0]}/{s[1]}':>8s}" for s in sms))
        top = {}
        for v in order:
            cells = []
            for s in sms:
                r = best.get((op, s, v))
                g = r["logical_gbps"]["mean"] if r else None
                if g is not None and g > top.get(s, (0, ""))[0]:
                    top[s] = (g, v)
                cells.append(f"{g:8.1f}" if g is not None else "       -")
            print(f"    {v:28s}" + "".join(cells))
        print(f"    {'best':28s}" + "".join(f"{top[s][0]:8.1f}" if s in top else "       -" for s in sms))
        print("      " + ", ".join(f"{s[0]}/{s[1]}: {top[s][1]}" for s in sms if s in top))
EOF
echo "total $(( $(date +%s) - start )) s" >> "$summary"
cat "$summary"
