#!/usr/bin/env bash
# Compile check for csrc/ on a machine without a GPU (CI): a kernel that does not compile never lands.
#
#   every .cu under csrc/   nvcc -c -rdc=true for sm_90a with the same nvcc flags as setup.py
#                           (+ torch's default nvcc flags), against the NVSHMEM headers;
#   every .cpp under csrc/  host-compiler syntax check with setup.py's flags.
# Host .cpp files (bindings glue) and any .cu that includes torch/ATen/c10/pybind11 headers also get
# torch's include dirs and Python's (a CPU torch ships them all, pybind11 included); torch-free .cu
# files (the kernels) are compiled without them.
#
# Needs: nvcc (CUDA 13; $CUDA_HOME, PATH or /usr/local/cuda), NVSHMEM headers from the
# nvidia-nvshmem-cu13==3.4.5 wheel (or $NVSHMEM_HOME), setuptools, and torch for the files above.
# Installs nothing. Env: MOE_CHECK_ARCH (default 90a), JOBS (parallel compiles, default nproc),
# PYTHON (default python3), CXX (default c++), NVCC_EXTRA (more nvcc flags, e.g. "-Xptxas -v"; its
# output is printed only for a failing file, or with VERBOSE=1). Arguments: check only these files (default: all of csrc/).
# Prints one line per file; exits non-zero if any file fails (its compiler output follows).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PYTHON=${PYTHON:-python3}
ARCH=${MOE_CHECK_ARCH:-90a}
JOBS=${JOBS:-$(nproc)}
CXX=${CXX:-c++}

# Flags and paths come from setup.py itself (importing it does not run setup()), so this check
# and the real build cannot drift apart.
config=$("$PYTHON" - <<'EOF'
import runpy, shlex, sysconfig
g = runpy.run_path("setup.py", run_name="moe_dispatcher_setup")
q = lambda xs: "(" + " ".join(shlex.quote(x) for x in xs) + ")"
print("NVSHMEM_ROOT=" + shlex.quote(g["find_nvshmem"]() or ""))
print("CUDA_ROOT=" + shlex.quote(g["find_cuda_home"]() or ""))
print("NVCC_FLAGS=" + q(g["NVCC_FLAGS"]))
print("CXX_FLAGS=" + q(g["CXX_FLAGS"]))
print("VERSION=" + shlex.quote(g["_project_version"]()))
print("PY_INCLUDE=" + shlex.quote(sysconfig.get_paths()["include"]))
try:
    import torch.utils.cpp_extension as ce
    print("TORCH_INCLUDES=" + q(["-I" + p for p in ce.include_paths()]))
    print("TORCH_NVCC_FLAGS=" + q(ce.COMMON_NVCC_FLAGS))
except Exception:
    print("TORCH_INCLUDES=()")
    print("TORCH_NVCC_FLAGS=()")
EOF
) || { echo "check_kernels_compile: could not read flags from setup.py" >&2; exit 2; }
eval "$config"

[[ -n "$CUDA_ROOT" ]] || { echo "check_kernels_compile: nvcc not found" >&2; exit 2; }
[[ -f "$NVSHMEM_ROOT/include/nvshmem.h" ]] || {
  echo "check_kernels_compile: NVSHMEM headers not found (pip install --no-deps" \
       "nvidia-nvshmem-cu13==3.4.5, or set NVSHMEM_HOME)" >&2
  exit 2
}
NVCC="$CUDA_ROOT/bin/nvcc"

# What the real build defines for every file (torch's CUDAExtension + setup.py).
DEFINES=(-DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C "-DMOE_DISPATCHER_VERSION=$VERSION")
INCLUDES=(-Icsrc "-I$NVSHMEM_ROOT/include")

needs_torch() {  # host .cpp (bindings glue) always; a .cu that includes torch/pybind11 directly
  [[ "$1" == *.cpp ]] ||
    grep -qE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"](torch|ATen|c10|pybind11)/' "$1"
}

check_one() {  # $1 = source file; prints the compiler output, returns its status
  local src=$1 extra=()
  if needs_torch "$src"; then
    [[ ${#TORCH_INCLUDES[@]} -gt 0 ]] || { echo "$src includes torch/pybind11 headers but torch is not importable"; return 1; }
    extra=("${TORCH_INCLUDES[@]}" "-I$PY_INCLUDE" "-I$tmp/shim")
  fi
  case "$src" in
    *.cu)
      "$NVCC" -c -rdc=true "${TORCH_NVCC_FLAGS[@]}" "${NVCC_FLAGS[@]}" \
        -gencode "arch=compute_$ARCH,code=sm_$ARCH" --compiler-options -fPIC \
        "${DEFINES[@]}" "${INCLUDES[@]}" "${extra[@]}" ${NVCC_EXTRA:-} "$src" -o /dev/null 2>&1 ;;
    *.cpp)
      "$CXX" -fsyntax-only -fPIC "${CXX_FLAGS[@]}" "${DEFINES[@]}" "${INCLUDES[@]}" \
        "-I$CUDA_ROOT/include" "-I$CUDA_ROOT/include/cccl" "${extra[@]}" "$src" 2>&1 ;;
  esac
}

if [[ $# -gt 0 ]]; then  # only the files named (e.g. the ones a change touched)
  files=("$@")
else
  mapfile -t files < <(find csrc -type f \( -name '*.cu' -o -name '*.cpp' \) | sort)
fi
[[ ${#files[@]} -gt 0 ]] || { echo "check_kernels_compile: no sources under csrc/"; exit 0; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# A CPU torch ships the c10/cuda headers but not the build-generated one they include; its CUDA
# builds define only the shared-library flag there. Searched after torch's own include dirs.
mkdir -p "$tmp/shim/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$tmp/shim/c10/cuda/impl/cuda_cmake_macros.h"
for i in "${!files[@]}"; do
  while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n; done
  (
    start=$SECONDS
    check_one "${files[$i]}" >"$tmp/$i.log"
    echo "$? $((SECONDS - start))" >"$tmp/$i.rc"
  ) &
done
wait

failed=0
for i in "${!files[@]}"; do
  read -r rc secs <"$tmp/$i.rc"
  if [[ "$rc" == 0 ]]; then
    printf 'ok    %-50s %3ss\n' "${files[$i]}" "$secs"
    [[ "${VERBOSE:-0}" == 1 ]] && sed 's/^/      /' "$tmp/$i.log"
  else
    printf 'FAIL  %-50s %3ss\n' "${files[$i]}" "$secs"
    sed 's/^/      /' "$tmp/$i.log"
    failed=$((failed + 1))
  fi
done
echo "check_kernels_compile: ${#files[@]} files, $failed failed (sm_$ARCH, nvcc $("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
(( failed == 0 ))
