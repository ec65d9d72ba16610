#!/usr/bin/env bash
# Run several branches' GPU scripts in one device call. Each branch is a git archive in .out/br/NAME.tgz (git -C WORKTREE archive --format=tar.gz -o .out/br/NAME.tgz HEAD) whose
# script is tools/gpu_NAME.sh (or $NAME_SCRIPT). All branches build in parallel in /tmp/b/NAME (in place), then
# each script runs from its own tree with PYTHONPATH=/tmp/b/NAME:/tmp/site, in the order given.
#   bash tools/gpu_branches.sh NAME[:LIMIT_S] ...
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_REMOTE_TRANSPORT=none
REPO=$PWD; R=${OUT:-$REPO/gpu-out}; mkdir -p "$R"
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
t0=$(date +%s)
for spec in "$@"; do
  n=${spec%%:*}
  if [ -f /tmp/b/$n/.built ] && cmp -s .out/br/$n.tgz /tmp/b/$n/.src.tgz; then continue; fi
  rm -rf /tmp/b/$n; mkdir -p /tmp/b/$n/.out; tar xzf .out/br/$n.tgz -C /tmp/b/$n; cp .out/br/$n.tgz /tmp/b/$n/.src.tgz
  cp .out/megatron_layer_bench.py /tmp/b/$n/.out/ 2>/dev/null
  ln -sfn ../integrations /tmp/b/$n/moe_dispatcher/integrations  # what the editable install maps
  ( cd /tmp/b/$n && MAX_JOBS=24 MOE_DISPATCHER_BUILD_EXT=1 python3 setup.py build_ext --inplace > build.log 2>&1 \
      && touch .built || echo "BUILD FAILED $n" ) &
done
wait
echo "builds done $(( $(date +%s) - t0 )) s"
for spec in "$@"; do
  n=${spec%%:*}; lim=${spec#*:}; [ "$lim" = "$spec" ] && lim=200
  [ -f /tmp/b/$n/.built ] || { echo "== $n: not built"; tail -n 30 /tmp/b/$n/build.log | grep -E "error|Error" | head; mkdir -p $R/$n; cp /tmp/b/$n/build.log $R/$n/; continue; }
  mkdir -p $R/$n; t1=$(date +%s)
  ( cd /tmp/b/$n && PYTHONPATH=/tmp/b/$n:/tmp/site OUT=$R/$n timeout -k 5 $lim bash tools/gpu_$n.sh > $R/$n/stdout.txt 2>&1 ); rc=$?
  echo "== $n rc=$rc $(( $(date +%s) - t1 )) s"; ls $R/$n/summary*.txt > /dev/null 2>&1 && cat $R/$n/summary*.txt | head -n 60 || tail -n 30 $R/$n/stdout.txt
done
