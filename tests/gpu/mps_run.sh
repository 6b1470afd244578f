#!/usr/bin/env bash
# Several ranks on ONE GPU for correctness runs when a multi-GPU machine is not at hand
# (NVSHMEM "multiple processes per GPU"): starts a CUDA MPS daemon (stopped at the end), limits
# each rank to 100 / RANKS percent of the GPU's threads so that every rank's cooperative grid is
# co-resident with its peers', and runs the given command with EP_RANKS=RANKS and EP_MPIRUN_ARGS
# (the mpirun options that pass the MPS settings on) exported:
#   source .devcarry/setup.sh && bash tests/gpu/mps_run.sh 2 bash tests/gpu/run_all.sh ep fp8
#   source .devcarry/setup.sh && bash tests/gpu/mps_run.sh 2 sh -c 'mpirun -np 2 $EP_MPIRUN_ARGS python3 SCRIPT'
# Speed figures from such runs mean nothing (the ranks share one GPU's SMs and memory).
set -u
ranks="$1"; shift
export CUDA_MPS_PIPE_DIRECTORY=/tmp/ep_mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ep_mps/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
# A daemon left by an earlier run that was killed (a timeout) would make -d fail: stop it first.
echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 && sleep 1
nvidia-cuda-mps-control -d || { echo "mps_run: could not start the MPS daemon"; exit 2; }
stop_daemon() { echo quit | nvidia-cuda-mps-control; }
child=""
trap '[ -n "$child" ] && kill "$child" 2>/dev/null; stop_daemon; exit 143' TERM INT
export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / ranks)) EP_RANKS="$ranks"
export EP_MPIRUN_ARGS="--oversubscribe -x PYTHONPATH -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE -x EP_RUNTIME_KERNEL_CACHE"
"$@" &  # (in the background, so that a TERM from timeout runs the trap at once)
child=$!
wait "$child"
rc=$?
stop_daemon
tail -5 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null | sed 's/^/mps_run: /'
exit $rc
