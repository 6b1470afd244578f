#!/usr/bin/env bash
# The GPU checks with kernels built by numba-cuda-mlir, 2 ranks on one GPU under MPS, on a lent machine
# whose image lacks numba-cuda-mlir: it comes in the pieces tools/mlir_carry.sh builds (.mlirp1/part,
# .mlirp2/part, ...), one device call each, into the ignored folders of a warm machine; the last call
# carries .devcarry/ and runs, from the repository root:
#   bash tests/gpu/mlir_run.sh DEADLINE_S [check ...]
# checks (default: all, in this order): ep fp8 graph. DEADLINE_S: seconds this script may take in all;
# each check gets what is left, at most its own limit. Logs go to $OUT/mlir_<check>.log (or
# /tmp/ep_gpu), the stack's versions and a line per check to $OUT/mlir_summary.txt, printed last.
# numba-cuda-mlir has no kernel cache here (ep_runtime/shmem/mlir_launch.py): every rank compiles its
# kernels, so there is no prebuild step.
set -u
[ $# -ge 1 ] || { echo "usage: bash tests/gpu/mlir_run.sh DEADLINE_S [ep fp8 graph]"; exit 2; }
t0=$(date +%s)
deadline=$(( t0 + $1 )); shift
checks=("$@"); [ ${#checks[@]} -eq 0 ] && checks=(ep fp8 graph)
out="${OUT:-/tmp/ep_gpu}"; mkdir -p "$out"
summary="$out/mlir_summary.txt"; : > "$summary"
say() { echo "$*" | tee -a "$summary"; }

# shellcheck source=/dev/null
source .devcarry/setup.sh
site=/tmp/mlirsite
if [ ! -f "$site/.ready" ]; then
  sums=.mlirp1/SHA256SUMS
  [ -f $sums ] || { say "mlir_run: $sums missing: carry every .mlirp*/ that tools/mlir_carry.sh built"; exit 3; }
  sha256sum --quiet -c $sums || { say "mlir_run: a piece is missing or differs (above): carry it again"; exit 3; }
  mkdir -p "$site"
  # the pieces in their order (.mlirp1, .mlirp2, ... .mlirp10)
  awk '{print $2}' $sums | sort -V | xargs cat | xz -dc | tar xf - -C "$site" \
    && touch "$site/.ready" || { say "mlir_run: unpacking into $site failed"; exit 3; }
fi
say "unpacked in $(( $(date +%s) - t0 )) s"
export PYTHONPATH="$site:$PYTHONPATH"

python3 - <<'PY' 2>&1 | tee -a "$summary"
import importlib.metadata as md, sys
print("python", sys.version.split()[0])
for dist in ("numba-cuda-mlir", "numba-cuda", "cuda-bindings", "cuda-core", "cuda-pathfinder", "numpy",
             "nvshmem4py-cu13", "nvidia-nvshmem-cu13", "nvidia-cuda-nvrtc", "nvidia-nvjitlink", "nvidia-nvvm",
             "nvidia-cuda-runtime"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist} (not installed)")
from cuda import pathfinder
for lib in ("nvrtc", "nvvm", "nvJitLink", "cudart"):
    try:
        print(lib, pathfinder.load_nvidia_dynamic_lib(lib).abs_path)
    except Exception as exc:  # noqa: BLE001 - printed for the record
        print(lib, "not found:", exc)
import numba_cuda_mlir
print("numba_cuda_mlir", numba_cuda_mlir.__file__)
from ep_runtime.kernels import compiler
compiler.select("numba-cuda-mlir")
from ep_runtime.kernels import cuda_api, shmem
print("kernels built by", cuda_api.COMPILER, "; NVSHMEM device bindings:", shmem.my_pe.__module__)
import cupy
print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver",
      cupy.cuda.runtime.driverGetVersion(), cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
PY

left() { echo $(( deadline - $(date +%s) )); }
check() {
  local name=$1 limit=$2; shift 2
  local l; l=$(left)
  [ "$l" -lt 60 ] && { say "mlir $name: SKIPPED ($l s left)"; return; }
  [ "$limit" -gt $((l - 15)) ] && limit=$((l - 15))
  local s; s=$(date +%s)
  timeout -k 10 "$limit" bash tests/gpu/mps_run.sh 2 sh -c "mpirun -np 2 \$EP_MPIRUN_ARGS -x PATH python3 $*" \
    > "$out/mlir_$name.log" 2>&1
  local rc=$?
  say "mlir $name: exit $rc in $(( $(date +%s) - s )) s (limit $limit s)$([ $rc -eq 124 ] && echo ': TIMED OUT')"
}
for c in "${checks[@]}"; do
  case "$c" in
    ep)    check ep 420 tests/gpu/ep_check.py --compiler numba-cuda-mlir --tokens 1024 64 --calls 5 --replays 3 ;;
    fp8)   check fp8 540 tests/gpu/fp8_check.py --compiler numba-cuda-mlir --tokens 1024 64 --replays 3 ;;
    graph) check graph 420 tests/gpu/graph_check.py --compiler numba-cuda-mlir --replays 20 ;;
    *)     say "mlir_run: unknown check $c (ep, fp8, graph)" ;;
  esac
done
for c in "${checks[@]}"; do
  f="$out/mlir_$c.log"; [ -f "$f" ] || continue
  echo "== mlir_$c.log"
  grep -v "Warning\|warn(\|cuGetProcAddress" "$f" | grep -E "PASS|FAIL|Error|Traceback|rank|exact|launch|compil|no module" \
    | tail -15
done
echo "== summary"; cat "$summary"
