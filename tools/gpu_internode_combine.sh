#!/usr/bin/env bash
# Internode combine check on the 4-GPU machine (pipelined combine, docs/internode.md), after the build of
# tools/gpu_suite.sh (STEPS=build bash tools/gpu_suite.sh 4). Under 4 minutes, fail fast:
#   the internode tests at MOE_DISPATCHER_NVL_SIZE=2 and =1 with the pipelined combine (each combine there is
#   also run with the old kernel and must give the same bits; the 1000-call loop switches kernels), stopping
#   at the first failure; then bench --mode internode --nvl-size 2, which times both combine kernels
#   (rows "combine" = pipelined, "combine-old"). Logs and summary in $OUT (summary_internode.txt).
#   bash tools/gpu_internode_combine.sh
set -u
export MOE_DISPATCHER_INTERNODE_COMBINE=pipelined FAIL_FAST=1 STEPS=${STEPS:-"tests bench"}
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu_internode.sh"
