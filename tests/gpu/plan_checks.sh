#!/usr/bin/env bash
# ep_check, fp8_check and graph_check (expanded and compact layouts) on every plan variant, 2 ranks: one mpirun
# job per check, each building a runtime of every plan one after another on one NVSHMEM session (--plans variants:
# the rules' default plan, then every receiver on every transport it can run on, ep_runtime.tools.gate_entries
# .PLAN_VARIANTS). Fill the kernel cache with every variant's kernels first, so that no job compiles:
#   source .devcarry/setup.sh && python3 -m ep_runtime.prebuild --all-variants --jobs 16 && bash tests/gpu/plan_checks.sh
# (prebuild builds every token format and both combine formats by default, at hidden 7168: what these jobs run.)
# Sections (default: all, in this order): ep fp8 graph graph_compact; name some to split the run across device calls:
#   bash tests/gpu/plan_checks.sh ep fp8
# Every check runs under the caller's EP_RUNTIME_PLAN (as in run_all.sh): a field it sets applies to every plan, and
# one it sets to another value than a variant's receiver or transport fails that variant (EPConfigError: a FAIL row).
# EP_RANKS (default 2) sets the ranks, EP_MPIRUN_ARGS adds mpirun options (tests/gpu/mps_run.sh sets both).
# Logs go to $OUT/plans_<section>.log (or /tmp/ep_gpu); the plan lines and table of each are printed, then its exit
# status. Exits 1 when a section failed.
set -u
out="${OUT:-/tmp/ep_gpu}"
mkdir -p "$out"
export EP_RUNTIME_PLAN="${EP_RUNTIME_PLAN:-}"
cache=""  # the kernel cache prebuild filled ($EP_RUNTIME_KERNEL_CACHE, else its default directory)
[ -n "${EP_RUNTIME_KERNEL_CACHE:-}" ] && cache="-x EP_RUNTIME_KERNEL_CACHE"
run="mpirun -np ${EP_RANKS:-2} ${EP_MPIRUN_ARGS:-} -x PYTHONPATH $cache -x EP_RUNTIME_PLAN"
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(ep fp8 graph graph_compact)
status=0
for s in "${sections[@]}"; do
  case "$s" in
    ep)    cmd="timeout 360 $run python3 tests/gpu/ep_check.py --plans variants --tokens 1024 64 --calls 10 --replays 5 --samples 10" ;;
    fp8)   cmd="timeout 420 $run python3 tests/gpu/fp8_check.py --plans variants --tokens 1024 64 --replays 3" ;;
    graph) cmd="timeout 240 $run python3 tests/gpu/graph_check.py --plans variants --replays 20" ;;
    graph_compact) cmd="timeout 240 $run python3 tests/gpu/graph_check.py --plans variants --replays 20 --layout compact" ;;
    *) echo "unknown section $s"; status=1; continue ;;
  esac
  echo "== $s: $cmd"
  $cmd > "$out/plans_$s.log" 2>&1
  rc=$?
  echo "== $s: exit $rc"
  [ "$rc" -eq 0 ] || status=1
  grep -v "Warning\|warn(\|cuGetProcAddress\|Saved host backtrace" "$out/plans_$s.log" \
    | grep -E "^(plan|FAIL|PASS|session init|hardware|layout|rank)|^ +[0-9]|Error|Traceback" | tail -100
done
exit $status
