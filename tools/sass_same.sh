#!/usr/bin/env bash
# Does a refactor change the machine code? Compiles the given .cu files (as tools/check_kernels_compile.sh
# does, sm_90a) in the working tree and at REV, and compares their SASS with the per-file name hashes
# removed. "same" means the GPUs run the very same instructions, so a GPU-free refactor needs no new GPU run.
#
#   bash tools/sass_same.sh REV csrc/kernels/intranode/combine.cu [more .cu files]
#
# Needs cuobjdump and nvdisasm ($CUOBJDUMP / $NVDISASM_PATH, else PATH, else the copies in the triton wheel).
# Exits 0 when every file is the same, 1 otherwise (the first lines of each difference are printed).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
[[ $# -ge 2 ]] || { sed -n '2,8p' "$0"; exit 2; }
rev=$1; shift
triton_bin=$(python3 -c "import os, triton; print(os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin'))" 2>/dev/null)
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || echo "$triton_bin/cuobjdump")}
export NVDISASM_PATH=${NVDISASM_PATH:-$(dirname "$(command -v nvdisasm || echo "$triton_bin/nvdisasm")")}
[[ -x "$CUOBJDUMP" ]] || { echo "sass_same: cuobjdump not found (set CUOBJDUMP)"; exit 2; }

tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/rev" > /dev/null 2>&1; rm -rf "$tmp"' EXIT
git worktree add --detach "$tmp/rev" "$rev" > /dev/null 2>&1 || { echo "sass_same: cannot check out $rev"; exit 2; }

# compile TREE OUTDIR FILES...: objects named after their paths, with check_kernels_compile.sh's flags.
compile() {
  local tree=$1 out=$2; shift 2
  mkdir -p "$out"
  sed 's#"$src" -o /dev/null#"$src" -o "$OBJ_DIR/$(echo "$src" | tr / _).o"#' tools/check_kernels_compile.sh \
    > "$tree/tools/.sass_compile.sh"
  (cd "$tree" && OBJ_DIR=$out bash tools/.sass_compile.sh "$@" > "$out/log.txt" 2>&1)
  local rc=$?
  rm -f "$tree/tools/.sass_compile.sh"
  return $rc
}
sass() {  # the SASS of an object, function names' per-file hashes and instruction addresses removed
  "$CUOBJDUMP" -sass "$1" | grep -v "Function :" | sed -E 's#/\*[0-9a-f]{4}\*/##g' | grep -v '^\s*$'
}

compile "$PWD" "$tmp/new" "$@" || { cat "$tmp/new/log.txt"; exit 2; }
compile "$tmp/rev" "$tmp/old" "$@" || { cat "$tmp/old/log.txt"; exit 2; }
status=0
for f in "$@"; do
  o=$(echo "$f" | tr / _).o
  if diff <(sass "$tmp/new/$o") <(sass "$tmp/old/$o") > "$tmp/diff.txt"; then
    echo "same      $f ($(sass "$tmp/new/$o" | wc -l) SASS lines)"
  else
    echo "DIFFERENT $f ($(grep -c '^[<>]' "$tmp/diff.txt") lines differ)"; head -n 12 "$tmp/diff.txt"; status=1
  fi
done
exit $status
