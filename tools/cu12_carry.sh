#!/usr/bin/env bash
# Builds .cu12p1/part, .cu12p2/part, ... in this checkout: the CUDA 12 stack (the `gpu-cu12` extra's)
# that running the GPU checks on it (tests/gpu/cu12_run.sh) needs on the lent GPU machines, whose image
# is CUDA 13's, as one xz tar cut into pieces of at most 50 MB, each to travel in a device call of its
# own (a call carries at most 64 MiB, the working tree included; docs/compilers.md, "On a GPU: what a
# run carries").
#
# What is packed, into one site-packages tree (CPython 3.12 x86-64 wheels, unpacked): nvshmem4py-cu12,
# cuda-bindings 12.9, cuda-pathfinder and cupy-cuda12x whole; of NVSHMEM 3.8 for CUDA 12 its headers,
# host library and UID / MPI bootstraps (not its device library's other pieces: the kernels link the
# bitcode nvshmem4py ships); NVRTC, nvJitLink, cudart and CCCL 12.9 whole; of nvcc 12.9 only NVVM
# (libNVVM and libdevice) and its headers. The image's numba-cuda 0.30.4 and NumPy serve both CUDA
# majors (numba-cuda finds the CUDA 12 libraries through cuda-pathfinder in the same tree).
#
# Usage, from the project root:   bash tools/cu12_carry.sh [WHEEL_DIR]
#   WHEEL_DIR: a folder holding (some of) the wheels below; pip downloads the others into it.
set -euo pipefail
root="$(git rev-parse --show-toplevel)"
cd "$root"
piece_bytes=50000000  # 50 MB: a piece plus the working tree stays well under a call's 64 MiB
stage="$(mktemp -d /tmp/cu12_carry.XXXXXX)"
trap 'rm -rf "$stage"' EXIT
wheels="${1:-$stage/wheels}"
mkdir -p "$wheels"

# name==version (what the gpu-cu12 extra resolves to, docs/plans.md "CUDA 12 (#65)") and what of it is packed
PACKAGES=(
  "nvshmem4py-cu12==0.4.1:all"
  "cuda-bindings==12.9.6:all"
  "cuda-pathfinder==1.9.1:all"
  "cupy-cuda12x==14.2.0:all"
  "nvidia-nvshmem-cu12==3.8.0:nvidia/nvshmem/include nvidia/nvshmem/lib/libnvshmem_host.so.3 nvidia/nvshmem/lib/nvshmem_bootstrap_uid.so.3 nvidia/nvshmem/lib/nvshmem_bootstrap_mpi.so.3"
  "nvidia-cuda-nvrtc-cu12==12.9.86:all"
  "nvidia-nvjitlink-cu12==12.9.86:all"
  "nvidia-cuda-runtime-cu12==12.9.79:all"
  "nvidia-cuda-cccl-cu12==12.9.27:all"
  "nvidia-cuda-nvcc-cu12==12.9.86:nvidia/cuda_nvcc/nvvm nvidia/cuda_nvcc/include"
)
site="$stage/site"
mkdir -p "$site"
for entry in "${PACKAGES[@]}"; do
  spec="${entry%%:*}"; keep="${entry#*:}"
  name="${spec%%==*}"; version="${spec#*==}"
  pattern="$(echo "$name" | tr - _)-$version-*.whl"
  # shellcheck disable=SC2086
  if ! ls "$wheels"/$pattern >/dev/null 2>&1; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$wheels" "$spec"
  fi
  # shellcheck disable=SC2086
  wheel="$(ls "$wheels"/$pattern | head -n 1)"
  if [ "$keep" = all ]; then
    python3 -m zipfile -e "$wheel" "$site"
  else
    mkdir -p "$stage/one" && python3 -m zipfile -e "$wheel" "$stage/one"
    for path in $keep; do
      mkdir -p "$site/$(dirname "$path")" && cp -r "$stage/one/$path" "$site/$path"
    done
    [ -f "$stage/one/nvidia/__init__.py" ] && cp "$stage/one/nvidia/__init__.py" "$site/nvidia/"
    rm -rf "$stage/one"
  fi
done
find "$site" -name __pycache__ -prune -exec rm -rf {} +
rm -rf .cu12p*/
tar -C "$site" -cf - . | xz -9 -T2 -c | split -b "$piece_bytes" -d -a 1 - "$stage/part."
n=0
for part in "$stage"/part.*; do
  n=$((n + 1))
  mkdir -p ".cu12p$n"
  mv "$part" ".cu12p$n/part"
done
sha256sum .cu12p*/part > .cu12p1/SHA256SUMS
echo "cu12_carry: the CUDA 12 stack in $n pieces:"
for i in $(seq 1 "$n"); do
  echo "  .cu12p$i/part $(stat -c %s ".cu12p$i/part") bytes"
done
echo "  unpacked: $(du -sb "$site" | cut -f1) bytes; sha256: .cu12p1/SHA256SUMS"
