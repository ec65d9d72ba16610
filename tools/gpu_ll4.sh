#!/usr/bin/env bash
# Low-latency host plans + combine send variants (branch ll4) on a 4-GPU machine, after the build
# (`STEPS=build bash tools/gpu_suite.sh 4`; wheels in /tmp/site): the low-latency GPU test cases at 4 GPUs
# under every variant, the 1000-call loop + graph test under the bulk one (every 5th combine switches to
# the thread copies), then the low-latency bench at 4 and 2 GPUs with the variants side by side (E=256, graph
# replay and events, NCCL beside). ~145 s.
#   variant 0  = per-expert dispatch + thread-copy combine send (the fallback when a rank has one expert)
#   variant 2  = dedup dispatch + thread-copy combine send (main's default)
#   variant 10 = dedup dispatch + bulk combine send (copy engine; MOE_DISPATCHER_LL_COMBINE_SEND=bulk)
# Logs under $OUT/ll4_logs, bench records $OUT/ll4_bench_N/, summary $OUT/summary_ll4.txt.
#
#   bash tools/gpu_ll4.sh     VARIANTS="0 2 10" LOOP_VARIANTS="10" BENCH_VARIANTS="2 10" DEADLINE_S=150
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1 MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-90} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-5}
export OUT=${OUT:-./gpu-out}
mkdir -p "$OUT/ll4_logs"
VARIANTS=${VARIANTS:-"0 2 10"}
LOOP_VARIANTS=${LOOP_VARIANTS:-"10"}
BENCH_VARIANTS=${BENCH_VARIANTS:-"2 10"}
DEADLINE_S=${DEADLINE_S:-150}
comma() { echo $1 | tr ' ' ','; }
GPUS=$(nvidia-smi -L | wc -l)
start=$(date +%s)
summary="$OUT/summary_ll4.txt"
: > "$summary"

if [ -d /tmp/site ]; then
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

left() { echo $(( DEADLINE_S - ($(date +%s) - start) )); }
# step NAME LIMIT_S CMD...: its log in $OUT/ll4_logs/NAME.log, one line (and the log's key lines) in the summary.
step() {
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  (( budget < 15 )) && { echo "SKIP $name (deadline)" | tee -a "$summary"; return; }
  (( limit > budget )) && limit=$budget
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" bash -c "$(declare -f tests bench); \"\$@\"" _ "$@" > "$OUT/ll4_logs/$name.log" 2>&1
  local rc=$?
  echo "$( ((rc == 0)) && echo PASS || echo "FAIL rc=$rc") $name ($(( $(date +%s) - t0 )) s)" | tee -a "$summary"
  grep -E "passed|failed|Error|error:|FAILED|timed out" "$OUT/ll4_logs/$name.log" | tail -n 12 | cut -c1-300 \
    | sed 's/^/    /' >> "$summary"
}
# tests VARIANTS N [-k EXPR]: the low-latency GPU tests of world size N only, under VARIANTS (comma list).
tests() {
  export MOE_LL_TEST_VARIANTS=$1
  local n=$2; shift 2
  local ids
  ids=$(python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider tests/test_low_latency_gpu.py "$@" 2>/dev/null \
        | grep -E "::.*\[([^]]*-)?$n(-[^]]*)?\]$")
  [ -n "$ids" ] || { echo "no tests collected for $n GPUs" >&2; return 1; }
  python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfE --tb=short $ids
}
# bench VARIANTS N: the low-latency bench at N GPUs, E=256, the variants side by side.
bench() {
  python3 -m moe_dispatcher.bench --mode low-latency --backend kernels --num-ranks "$2" --ll-experts 256 \
    --ll-variants "$1" --out-dir "$OUT/ll4_bench_$2"
}

{ nvidia-smi -L; git log --oneline -1 2>/dev/null; echo "variants: tests $VARIANTS, loop $LOOP_VARIANTS, bench $BENCH_VARIANTS"; } >> "$summary" 2>&1
(( GPUS >= 4 )) && step tests_cases_4gpu 55 tests "$(comma "$VARIANTS")" 4 -k cases
(( GPUS >= 4 )) && step tests_loop_4gpu 35 tests "$(comma "$LOOP_VARIANTS")" 4 -k loop
(( GPUS >= 4 )) && step bench_4gpu 35 bench "$(comma "$BENCH_VARIANTS")" 4
(( GPUS >= 2 )) && step bench_2gpu 30 bench "$(comma "$BENCH_VARIANTS")" 2

# Figures: per variant, dispatch / combine / dispatch+combine medians (graph replay and events), NCCL beside.
python3 - "$OUT" >> "$summary" 2>&1 <<'EOF'
import glob, json, sys
names = {0: "per_expert+threads", 2: "dedup+threads", 10: "dedup+bulk", 8: "per_expert+bulk"}
for n in (4, 2):
    files = sorted(glob.glob(f"{sys.argv[1]}/ll4_bench_{n}/bench_low-latency_*x{n}_*.json"))
    if not files:  # the bench died before writing its records: its progress lines (means) instead
        print(f"== {n} GPUs: no bench records; progress lines of the log (mean us):")
        try:
            for line in open(f"{sys.argv[1]}/ll4_logs/bench_{n}gpu.log"):
                if line.startswith("[low-latency] E=256"):
                    print("  " + line.rstrip()[:170])
        except OSError:
            pass
        continue
    recs = [r for r in json.load(open(files[-1]))["records"] if r.get("section") == "low-latency"]
    nccl = {}
    rows = {}
    for r in recs:
        if r.get("num_experts") != 256 or r.get("backend") == "nccl":
            continue
        key = (r["path"], r["op"])
        if "nccl" in r:
            nccl[key] = r["nccl"]["t_us"]["mean"]
        rows.setdefault(r.get("variant", -1), {})[key] = r["t_us_median"]["max"]
    print(f"== {n} GPUs, E=256, T=128, H=7168, top-8, FP8 dispatch: median us (slowest rank); "
          "target 4 GPUs 28 / 45 / 70, 2 GPUs (DeepEP) 29 / 40 / 72")
    for path in ("graph", "events"):
        print(f"  {path:6s} {'variant':18s} {'dispatch':>9s} {'combine':>9s} {'both':>9s}")
        for v, got in rows.items():
            vals = [got.get((path, op)) for op in ("dispatch", "combine", "dispatch+combine")]
            print(f"  {path:6s} {names.get(v, str(v)):18s} " + " ".join(f"{x:9.1f}" if x else "        -" for x in vals))
        vals = [nccl.get((path, op)) for op in ("dispatch", "combine", "dispatch+combine")]
        print(f"  {path:6s} {'NCCL a2a (mean)':18s} " + " ".join(f"{x:9.1f}" if x else "        -" for x in vals))
EOF
echo "total $(( $(date +%s) - start )) s" | tee -a "$summary"
cat "$summary"
