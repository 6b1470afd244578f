#!/usr/bin/env bash
# Several ranks on ONE GPU for correctness runs when a multi-GPU machine is not at hand
# (NVSHMEM "multiple processes per GPU"): starts a CUDA MPS daemon (user-space; stopped at the
# end), limits each rank to 100 / ranks percent of the GPU's threads so that every rank's
# cooperative grid is co-resident, and runs the given script under mpirun:
#   source .devcarry/setup.sh && bash tests/gpu/mps_run.sh RANKS python3 SCRIPT [ARGS...]
# Speed figures from such runs mean nothing (the ranks share one GPU's SMs and memory).
set -u
ranks="$1"; shift
export CUDA_MPS_PIPE_DIRECTORY=/tmp/ep_mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ep_mps/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "mps_run: could not start the MPS daemon"; exit 2; }
export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / ranks))
mpirun -np "$ranks" --oversubscribe -x PYTHONPATH -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY \
  -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE -x EP_RUNTIME_KERNEL_CACHE "$@"
rc=$?
echo quit | nvidia-cuda-mps-control
exit $rc
