source .devcarry/setup.sh
nvidia-smi topo -m | head -6
R="mpirun -np 4 -x PYTHONPATH"
f() { n=$1; shift; t=$1; shift; timeout $t $R "$@" > $OUT/$n.log 2>&1; echo "== $n exit $?"; grep -v "Warning\|warn(" $OUT/$n.log | grep -E "PASS|FAIL|Error|^ *[0-9]|graph mode|ceilings" | tail -${TAILN:-14}; }
f ep4 230 python3 tests/gpu/ep_check.py --calls 10 --replays 10
TAILN=20 f bench4 250 python3 -m ep_runtime.bench --mode eager graph --tokens 128 4096 --json $OUT/bench4.json
