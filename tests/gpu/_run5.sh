#!/usr/bin/env bash
# session 4, device call 5: EP4 (4 x H200): correctness (bf16, FP8) and bench at T=128, 4096
set -u
export EP_RUNTIME_KERNEL_CACHE=$PWD/.kcache
run="mpirun -np 4 -x PYTHONPATH -x EP_RUNTIME_KERNEL_CACHE"
f() { echo "== $1"; shift; "$@" > $OUT/log_tmp 2>&1; rc=$?; cat $OUT/log_tmp >> $OUT/all.log; grep -v "Warning\|warn(\|cuGetProcAddress" $OUT/log_tmp | tail -${TAILN:-16}; echo "== exit $rc"; }
nvidia-smi topo -m | head -6
TAILN=12 f ep4 timeout 200 $run python3 tests/gpu/ep_check.py --tokens 4096 128 --calls 20 --replays 20 --samples 20
TAILN=10 f fp8_4 timeout 200 $run python3 tests/gpu/fp8_check.py --tokens 4096 128 --replays 5
TAILN=40 f bench4 timeout 240 $run python3 -m ep_runtime.bench --tokens 128 4096 --token-dtype bfloat16 fp8_e4m3 --layout compact expanded --mode graph --samples 40 --json $OUT/bench_ep4.json
rm -f $OUT/log_tmp
