#!/usr/bin/env bash
# Builds .mlirp1/part, .mlirp2/part, ... in this checkout: what running the GPU checks with kernels built
# by numba-cuda-mlir (tests/gpu/mlir_run.sh) needs on the lent GPU machines beyond their image and
# .devcarry/, as one xz tar cut into pieces of at most 50 MB, so that each piece travels in a device
# call of its own (a call carries at most 64 MiB, the working tree included; docs/compilers.md,
# "On a GPU: what a run carries").
#
# What is packed: numba-cuda-mlir 0.6.0, the CPython 3.12 x86-64 wheel, unpacked (its MLIR and LLVM
# libraries are most of it). What is not, and why: its other requirements (cuda-bindings 13.*,
# cuda-core >= 0.5.1 and < 2, NumPy, cuda-toolkit 13's cudart, NVRTC, NVVM and nvJitLink) are the
# image's, which numba-cuda 0.30.4 for CUDA 13 already needs there at the same bounds; only its
# cuda-toolkit extra's nvcc is not (nothing of numba-cuda-mlir's Python calls nvcc or ptxas: PTX
# goes through libNVVM and nvJitLink); nvshmem4py with its numba-cuda-mlir device bindings and
# NVSHMEM 3.8 come with .devcarry/; typing-extensions is required below Python 3.12 only.
# tests/gpu/mlir_run.sh prints the versions the run found.
#
# Usage, from the project root:   bash tools/mlir_carry.sh [WHEEL]
#   WHEEL: numba_cuda_mlir-0.6.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl (otherwise
#   pip downloads it: pip download --no-deps --only-binary=:all: --python-version 3.12 ...).
set -euo pipefail
root="$(git rev-parse --show-toplevel)"
cd "$root"
piece_bytes=50000000  # 50 MB: a piece plus the working tree stays well under a call's 64 MiB
version=0.6.0
stage="$(mktemp -d /tmp/mlirgpu_carry.XXXXXX)"
trap 'rm -rf "$stage"' EXIT

wheel="${1:-}"
if [ -z "$wheel" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$stage/wheel" "numba-cuda-mlir==$version"
  wheel="$(ls "$stage"/wheel/numba_cuda_mlir-$version-cp312-*.whl)"
fi
case "$(basename "$wheel")" in
  numba_cuda_mlir-$version-cp312-cp312-*x86_64*.whl) ;;
  *) echo "mlir_carry: $wheel is not numba-cuda-mlir $version's CPython 3.12 x86-64 wheel (the lent image's Python)" >&2
     exit 2 ;;
esac

mkdir -p "$stage/site"
python3 -m zipfile -e "$wheel" "$stage/site"
find "$stage/site" -name __pycache__ -prune -exec rm -rf {} +
rm -rf .mlirp*/
tar -C "$stage/site" -cf - . | xz -9 -T2 -c | split -b "$piece_bytes" -d -a 1 - "$stage/part."
n=0
for part in "$stage"/part.*; do
  n=$((n + 1))
  mkdir -p ".mlirp$n"
  mv "$part" ".mlirp$n/part"
done
sha256sum .mlirp*/part > "$stage/sums"
echo "mlir_carry: $(basename "$wheel") in $n pieces:"
for i in $(seq 1 "$n"); do
  echo "  .mlirp$i/part $(stat -c %s ".mlirp$i/part") bytes"
done
echo "  unpacked: $(du -sb "$stage/site" | cut -f1) bytes; sha256: .mlirp1/SHA256SUMS"
mv "$stage/sums" .mlirp1/SHA256SUMS
