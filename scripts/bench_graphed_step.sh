#!/usr/bin/env bash
# The CUDA-graphed steps against plain zrs and the one-GPU bounds, on the device machine, one
# GPU, in one call:
#   bash scripts/bench_graphed_step.sh OUTFILE [PRESET]
# Runs the GPU tests of the graphed optimizer step and of the captured whole step (both
# bit-identical to ungraphed; the graphed step's tests read the GPU suite's one group of
# workers, tests/support/gpu_group.py, which runs all its cases, here at world 1), then PRESET
# (default 1b) with zrs_graphed and zrs_captured alternating (A B B A), then zrs, single_amp and
# single.
set -uo pipefail
OUTFILE=${1:?usage: bench_graphed_step.sh OUTFILE [PRESET]} PRESET=${2:-1b}
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash scripts/device_setup.sh true || exit 1
export PYTHONPATH=/tmp/site
ZRS_GPU_WORLD=1 timeout 400 python3 -m pytest -p no:cacheprovider -q \
  tests/gpu/test_graphed_gpu.py tests/gpu/test_captured_gpu.py
for sys in zrs_graphed zrs_captured zrs_captured zrs_graphed zrs single_amp single; do
  timeout 120 torchrun --standalone --nproc-per-node 1 benches/step.py --preset "$PRESET" \
    --systems "$sys" --warmup 5 --steps 15 --out "$OUTFILE" || echo "$sys failed: rc=$?"
done
python3 benches/step.py --table "$OUTFILE"
