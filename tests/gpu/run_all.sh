#!/usr/bin/env bash
# The GPU checks in one device call (2 ranks), each section under its own time limit:
#   source .devcarry/setup.sh && bash tests/gpu/run_all.sh [section ...]
# Sections (default: all, in this order): shmem ep ep_puts graph graph_compact graph_rows fp8 soak stream zerocopy
# example bench kernels stores host racecheck memcheck. graph / graph_compact: one CUDA graph, 100 replays, expanded /
# compact layout; graph_rows: capacity 4096 (whole flagged rows at the largest replays, parts at small ones).
# ep_puts: ep_check with the kernels sending through NVSHMEM puts (EP_RUNTIME_PLAN=transport=puts).
# Every section runs under the caller's EP_RUNTIME_PLAN (plan overrides: ep_runtime.core.plan), so
#   EP_RUNTIME_PLAN=receiver=land bash tests/gpu/run_all.sh ep graph fp8
# runs those checks on the landing plan (tests/gpu/plan_checks.sh runs them on every plan variant).
# stores: dispatch_async's store pattern alone against the copy engine; host: host time per call, broken down.
# EP_RANKS (default 2) sets the ranks, EP_MPIRUN_ARGS adds mpirun options (tests/gpu/mps_run.sh sets both).
# Logs go to $OUT/<section>.log (or /tmp/ep_gpu); the tail of each is printed.
set -u
out="${OUT:-/tmp/ep_gpu}"
mkdir -p "$out"
run="mpirun -np ${EP_RANKS:-2} ${EP_MPIRUN_ARGS:-} -x PYTHONPATH -x NVSHMEM_DISABLE_CUDA_VMM -x EP_RUNTIME_PLAN"
export NVSHMEM_DISABLE_CUDA_VMM=1  # compute-sanitizer cannot follow NVSHMEM's VMM heap mappings
plan="${EP_RUNTIME_PLAN:-}"  # the caller's overrides for every section but ep_puts
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(shmem ep ep_puts graph graph_compact graph_rows graph_batched fp8 soak stream
                                        zerocopy example bench kernels stores host racecheck memcheck)
for s in "${sections[@]}"; do
  case "$s" in
    shmem)     cmd="timeout 180 $run python3 tests/gpu/shmem_check.py" ;;
    ep)        cmd="timeout 240 $run python3 tests/gpu/ep_check.py --calls 100" ;;
    ep_puts)   cmd="timeout 240 $run python3 tests/gpu/ep_check.py --calls 10 --replays 10" ;;
    graph)     cmd="timeout 180 $run python3 tests/gpu/graph_check.py --replays 100" ;;
    graph_compact) cmd="timeout 180 $run python3 tests/gpu/graph_check.py --replays 100 --layout compact" ;;
    graph_rows) cmd="timeout 240 $run python3 tests/gpu/graph_check.py --capacity 4096 --hidden 2048 --replays 20 --layout compact" ;;
    graph_batched) cmd="timeout 240 $run python3 tests/gpu/batched_graph_check.py --replays 50 --scenario masked" ;;
    soak)      cmd="timeout 150 $run python3 tests/gpu/soak.py --calls 10000" ;;
    stream)    cmd="timeout 120 $run python3 tests/gpu/stream_order_check.py" ;;
    zerocopy)  cmd="timeout 120 $run python3 tests/gpu/zero_copy_check.py" ;;
    kernels)   cmd="timeout 150 $run python3 tests/gpu/kernel_times.py --tokens 128 4096 --repeat 20" ;;
    stores)    cmd="timeout 200 $run python3 tests/gpu/store_pattern.py" ;;
    host)      cmd="timeout 150 $run python3 tests/gpu/host_costs.py --profile 200" ;;
    fp8)       cmd="timeout 420 $run python3 tests/gpu/fp8_check.py --tokens 4096 128" ;;
    example)   cmd="timeout 150 $run python3 examples/moe_layer.py --hidden 1024 --ffn 512 --experts 16 --top-k 4 --tokens 256" ;;
    bench)     cmd="timeout 300 $run python3 -m ep_runtime.tools.bench --tokens 128 4096 --layout expanded compact --json $out/bench.json" ;;
    racecheck) cmd="timeout 240 $run compute-sanitizer --tool racecheck --print-limit 5 python3 tests/gpu/ep_check.py --tokens 32 --calls 1 --replays 0 --samples 1" ;;
    memcheck)  cmd="timeout 500 $run compute-sanitizer --tool memcheck --leak-check no --report-api-errors no --check-device-heap no --print-limit 20 python3 tests/gpu/ep_check.py --tokens 32 --hidden 1024 --experts 16 --top-k 4 --calls 1 --replays 0 --samples 1" ;;
    *) echo "unknown section $s"; continue ;;
  esac
  echo "== $s: $cmd"
  if [ "$s" = ep_puts ]; then export EP_RUNTIME_PLAN="transport=puts"; else export EP_RUNTIME_PLAN="$plan"; fi
  $cmd > "$out/$s.log" 2>&1
  echo "== $s: exit $?"
  grep -v "Warning\|warn(\|cuGetProcAddress\|Saved host backtrace" "$out/$s.log" | grep -E "SUMMARY|PASS|FAIL|rank|^ +[0-9]|ceilings|init|Error" | tail -14
done
