#!/usr/bin/env bash
# Host-code smoke test of nvlink_probe without a GPU: builds the probe against the shared CUDA runtime and
# runs it on fake_cudart.cpp (a CPU stand-in: kernels re-implemented on the CPU, no waits, no timing), small
# shapes, 2..8 fake GPUs; then checks that dropped rows / tokens make the combine check fail (exit status 3).
# Tests the routing, the offset tables, buffer sizes, launch arguments and the checks, not the device code.
# Needs nvcc and g++. Exit status 0 when everything behaves.
#
#   bash tools/nvlink_probe/cpu_smoke.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
nvcc=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
# the toolkit's include directory (nvcc may be a wrapper script elsewhere): nvcc's own TOP
inc=$("$nvcc" -dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)/include
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$nvcc" -arch=sm_90a -O3 -cudart shared -o "$dir/probe" tools/nvlink_probe/nvlink_probe.cu || exit 1
g++ -O2 -shared -fPIC -I"$inc" -Wl,-soname,libcudart.so.13 -o "$dir/libcudart.so.13" tools/nvlink_probe/fake_cudart.cpp || exit 1
run() { LD_LIBRARY_PATH="$dir" FAKE_GPUS=8 timeout 300 "$dir/probe" --tokens 200 --sms 4 --threads 512 --iters 1 --warmup 0 "$@" 2>&1; }
status=0
for args in "--gpus 4 --hidden 7168,1024" "--gpus 2 --hidden 1024" "--gpus 8 --hidden 1024 --ops combine" \
            "--gpus 4 --topk 1 --hidden 512 --ops combine" "--gpus 3 --experts 7 --topk 3 --hidden 256 --ops combine"; do
  out=$(run $args); rc=$?
  if [ $rc -eq 0 ]; then echo "ok    $args"; else echo "FAIL  $args (exit $rc)"; echo "$out" | tail -5; status=1; fi
done
for b in pull reduce push skiptoken; do
  out=$(FAKE_BREAK=$b run --gpus 4 --hidden 1024 --ops combine); rc=$?
  if [ $rc -eq 3 ]; then echo "ok    FAKE_BREAK=$b caught"; else echo "FAIL  FAKE_BREAK=$b: exit $rc, want 3"; status=1; fi
done
exit $status
