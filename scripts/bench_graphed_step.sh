#!/usr/bin/env bash
# The optimizer step as a CUDA graph (zrs.GraphedStep) against plain zrs and the one-GPU bounds,
# on the device machine, one GPU, in one call:
#   bash scripts/bench_graphed_step.sh OUTFILE [PRESET]
# Runs the GPU test of the graphed step (bit-identical to ungraphed), then PRESET (default 1b)
# with zrs and zrs_graphed alternating (A B B A), then single_amp and single.
set -uo pipefail
OUTFILE=${1:?usage: bench_graphed_step.sh OUTFILE [PRESET]} PRESET=${2:-1b}
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash scripts/device_setup.sh true || exit 1
export PYTHONPATH=/tmp/site
ZRS_GPU_WORLD=1 timeout 200 python3 -m pytest -p no:cacheprovider tests/gpu/test_graphed_gpu.py -q
for sys in zrs zrs_graphed zrs_graphed zrs single_amp single; do
  timeout 120 torchrun --standalone --nproc-per-node 1 benches/step.py --preset "$PRESET" \
    --systems "$sys" --warmup 5 --steps 15 --out "$OUTFILE" || echo "$sys failed: rc=$?"
done
python3 benches/step.py --table "$OUTFILE"
