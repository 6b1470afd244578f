#!/usr/bin/env bash
# The GPU checks on the CUDA 12 stack (the gpu-cu12 extra), 2 ranks on one GPU under MPS, on a lent machine
# whose image is CUDA 13's: the stack comes in the pieces tools/cu12_carry.sh builds (.cu12p1/part,
# .cu12p2/part, ...), one device call each into the ignored folders of a warm machine (carry [".cu12pN"]);
# the last call runs, from the repository root (no .devcarry/: this is the other stack):
#   bash tests/gpu/cu12_run.sh DEADLINE_S [check ...]
# checks (default: all, in this order): prebuild ep fp8 graph. DEADLINE_S: seconds this script may take
# in all; each check gets what is left, at most its own limit. Logs go to $OUT/cu12_<check>.log (or
# /tmp/ep_gpu), the stack's versions and a line per check to $OUT/cu12_summary.txt, printed last.
set -u
[ $# -ge 1 ] || { echo "usage: bash tests/gpu/cu12_run.sh DEADLINE_S [prebuild ep fp8 graph]"; exit 2; }
t0=$(date +%s)
deadline=$(( t0 + $1 )); shift
checks=("$@"); [ ${#checks[@]} -eq 0 ] && checks=(prebuild ep fp8 graph)
out="${OUT:-/tmp/ep_gpu}"; mkdir -p "$out"
summary="$out/cu12_summary.txt"; : > "$summary"
say() { echo "$*" | tee -a "$summary"; }

venv=/tmp/cu12venv
if [ ! -f "$venv/.ready" ]; then
  sums=.cu12p1/SHA256SUMS
  [ -f $sums ] || { say "cu12_run: $sums missing: carry every .cu12p*/ that tools/cu12_carry.sh built"; exit 3; }
  sha256sum --quiet -c $sums || { say "cu12_run: a piece is missing or differs (above): carry it again"; exit 3; }
  # the image's Python, NumPy, numba-cuda and mpi4py, with the CUDA 12 stack laid over them
  python3 -m venv --system-site-packages "$venv"
  site="$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
  awk '{print $2}' $sums | sort -V | xargs cat | xz -dc | tar xf - -C "$site" \
    || { say "cu12_run: unpacking into $site failed"; exit 3; }
  # numba-cuda 0.30.4 registers np.row_stack, which the image's NumPy 2.5 dropped (as .devcarry/setup.sh)
  printf 'try:\n    import numpy\n    if not hasattr(numpy, "row_stack"):\n        numpy.row_stack = numpy.vstack\nexcept Exception:\n    pass\n' \
    > "$site/sitecustomize.py"
  touch "$venv/.ready"
fi
say "unpacked in $(( $(date +%s) - t0 )) s"
export PATH="$venv/bin:$PATH" PYTHONPATH="$PWD"
# as .devcarry/setup.sh: NVLink multicast off on these shared hosts; one host, bootstrap over loopback
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
export EP_RUNTIME_KERNEL_CACHE=/tmp/kcache_cu12

python3 - <<'PY' 2>&1 | tee -a "$summary"
import importlib.metadata as md, sys
print("python", sys.version.split()[0])
for dist in ("nvshmem4py-cu12", "cuda-bindings", "cuda-pathfinder", "cupy-cuda12x", "numba-cuda", "numpy"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist} (not installed)")
from cuda import pathfinder
for lib in ("nvrtc", "nvvm", "nvJitLink", "cudart", "nvshmem_host"):
    try:
        print(lib, pathfinder.load_nvidia_dynamic_lib(lib).abs_path)
    except Exception as exc:  # noqa: BLE001 - printed for the record
        print(lib, "not found:", exc)
import cupy
print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver",
      cupy.cuda.runtime.driverGetVersion(), cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
PY

left() { echo $(( deadline - $(date +%s) )); }
run_check() {  # name limit command...
  local name=$1 limit=$2; shift 2
  local l; l=$(left)
  [ "$l" -lt 60 ] && { say "cu12 $name: SKIPPED ($l s left)"; return; }
  [ "$limit" -gt $((l - 15)) ] && limit=$((l - 15))
  local s; s=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$out/cu12_$name.log" 2>&1
  local rc=$?
  say "cu12 $name: exit $rc in $(( $(date +%s) - s )) s (limit $limit s)$([ $rc -eq 124 ] && echo ': TIMED OUT')"
}
mps_check() {  # name limit script args...: 2 ranks under MPS
  local name=$1 limit=$2; shift 2
  run_check "$name" "$limit" bash tests/gpu/mps_run.sh 2 sh -c "mpirun -np 2 \$EP_MPIRUN_ARGS -x PATH python3 $*"
}
for c in "${checks[@]}"; do
  case "$c" in
    prebuild) run_check prebuild 240 python3 -m ep_runtime.prebuild --jobs 16 ;;
    ep)       mps_check ep 300 tests/gpu/ep_check.py --tokens 1024 64 --calls 5 --replays 3 ;;
    fp8)      mps_check fp8 300 tests/gpu/fp8_check.py --tokens 1024 64 --replays 3 ;;
    graph)    mps_check graph 300 tests/gpu/graph_check.py --replays 20 ;;
    *)        say "cu12_run: unknown check $c (prebuild, ep, fp8, graph)" ;;
  esac
done
for c in "${checks[@]}"; do
  f="$out/cu12_$c.log"; [ -f "$f" ] || continue
  echo "== cu12_$c.log"
  grep -v "Warning\|warn(\|cuGetProcAddress" "$f" | grep -E "PASS|FAIL|Error|Traceback|rank|exact|compiled|built" \
    | tail -15
done
echo "== summary"; cat "$summary"
