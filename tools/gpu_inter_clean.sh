#!/usr/bin/env bash
# Branch inter-clean (the old internode combine kernel removed; only the per-warp-chunk one is left), on the
# 4-GPU machine after STEPS=build bash tools/gpu_suite.sh 4 (export PYTHONPATH=/tmp/site). About 1 minute:
# tools/gpu_internode.sh failing fast: the internode tests at MOE_DISPATCHER_NVL_SIZE=2 and =1 (each combine
# also run at warp-chunk sizes 1 and 32 and compared bit for bit; the 1000-call loop switches chunk sizes),
# then bench --mode internode --nvl-size 2. Logs and summary in $OUT (summary_internode.txt).
#   bash tools/gpu_inter_clean.sh
set -u
export FAIL_FAST=1
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu_internode.sh"
