#!/usr/bin/env bash
# Runs a command with NVIDIA MPS on (one GPU shared by the attention and FFN processes runs them
# concurrently instead of time-slicing), and always stops MPS again, whatever the command does.
# MPS is a user-space server: the GPU's compute mode, MIG and clocks are not touched.
#
#   bash tests/gpu/with_mps.sh SECONDS COMMAND...     (the command runs under `timeout SECONDS`)
#
# The pipe and log folders are under /tmp; AFD_MPS=1 is exported so benchmarks record it.
set -uo pipefail
limit=$1
shift
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
stop_mps() { echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true; }
trap stop_mps EXIT
nvidia-cuda-mps-control -d || { echo "MPS did not start" >&2; exit 1; }
export AFD_MPS=1
timeout --signal=TERM --kill-after=20 "$limit" "$@"
