#!/usr/bin/env bash
# The whole check of one tree on an N-GPU machine (N = $1, default 4), in one device call (~7 minutes on 4;
# stops before DEADLINE_S): build, every GPU test family (intranode, expert-major, low-latency at every world
# size up to N, internode with domains of N/2 and N/4 GPUs (2 x 2 and 4 x 1 on 4; 2 x 4 and 4 x 2 on 8),
# Megatron parity and the 200-step training curve), the benches beside NCCL (normal and low-latency at N and
# 2, internode in domains of N/2), the NVLink ceilings, the host overhead of cached calls, the low-latency phase
# trace (tools/ll_trace.py), the Megatron yardstick
# ($LAYER_BENCH, default .out/megatron_layer_bench.py: copy shared/tools/megatron_layer_bench.py there) and
# the round-trip profile. Logs in $OUT/logs, bench files in $OUT, the summary in $OUT/session_summary.txt;
# everything is packed into $OUT/session.tgz at the end (the device tool brings back only a few files).
#   bash tools/gpu_session_check.sh [N]        DEADLINE_S=400 SKIP="yardstick host_profile" bash tools/gpu_session_check.sh 8
set -u
N=${1:-4}
export OUT=${OUT:-./gpu-out}
export MOE_TEST_TIMEOUT=${MOE_TEST_TIMEOUT:-120} MOE_DISPATCHER_TIMEOUT_S=${MOE_DISPATCHER_TIMEOUT_S:-10}
DEADLINE_S=${DEADLINE_S:-560}
LAYER_BENCH=${LAYER_BENCH:-.out/megatron_layer_bench.py}
start=$(date +%s)
summary="$OUT/session_summary.txt"
mkdir -p "$OUT/logs"
: > "$summary"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
KEYS="passed|failed|FAILED|^E  |round trip|yardstick floor|public cached|public combine|GB/s|wrote .*\.md"

STEPS=build OUT="$OUT/build" bash tools/gpu_suite.sh "$N" > "$OUT/logs/build.txt" 2>&1
grep -E "PASS|FAIL" "$OUT/build/summary.txt" | tee -a "$summary"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
PYTEST=(python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short)  # an array: `timeout` runs no functions

run intranode_gpu 110 "${PYTEST[@]}" tests/test_intranode_gpu.py
run expert_major_gpu 90 "${PYTEST[@]}" tests/test_expert_major_gpu.py
run low_latency_gpu 110 "${PYTEST[@]}" -s tests/test_low_latency_gpu.py
run internode_gpu 90 "${PYTEST[@]}" -x -s tests/test_internode_gpu.py -k "$N-nvl$((N / 2)) or $N-nvl$((N / 4))"
run megatron_layer_gpu 60 "${PYTEST[@]}" tests/test_megatron_layer.py
run bench_normal_$N 90 python3 -m moe_dispatcher.bench --mode normal --backend kernels --num-ranks "$N" --num-sms 8,16,20,22,24 \
  --plot-sweep --out-dir "$OUT"
run bench_normal_2 40 python3 -m moe_dispatcher.bench --mode normal --backend kernels --num-ranks 2 --num-sms 16,20,24 \
  --out-dir "$OUT"
run bench_ll_$N 40 python3 -m moe_dispatcher.bench --mode low-latency --num-ranks "$N" --out-dir "$OUT"
run bench_ll_2 40 python3 -m moe_dispatcher.bench --mode low-latency --num-ranks 2 --out-dir "$OUT"
run ll_trace 40 torchrun --standalone --nproc_per_node "$N" tools/ll_trace.py --modes graph,graph_dd --out "$OUT"
run bench_internode 60 python3 -m moe_dispatcher.bench --mode internode --nvl-size $((N / 2)) --backend kernels --num-ranks "$N" \
  --out-dir "$OUT"
run nvlink_ceiling 40 python3 tools/nvlink_ceiling.py
run nvlink_ceiling_2 30 env CUDA_VISIBLE_DEVICES=0,1 python3 tools/nvlink_ceiling.py
run host_profile 40 torchrun --standalone --nproc_per_node 2 tools/host_profile.py "$OUT"
[ -f "$LAYER_BENCH" ] && run yardstick 100 torchrun --standalone --nproc_per_node "$N" "$LAYER_BENCH"
run round_trip_profile 80 torchrun --standalone --nproc_per_node "$N" tools/profile_round_trip.py
run megatron_train 100 "${PYTEST[@]}" tests/test_megatron_train.py
echo "total $(( $(date +%s) - start )) s" >> "$summary"
cat "$summary"
tar czf /tmp/session.tgz -C "$OUT" --exclude='*.pt' --exclude='*.tgz' . && find "$OUT" -mindepth 1 -delete \
  && mv /tmp/session.tgz "$OUT/"
