#!/usr/bin/env bash
# zrs with bf16 masters (master_dtype=torch.bfloat16: single's recipe, no fp32 copy) and the whole
# step captured, against the compiled one-GPU bound `single`, on the device machine, one GPU:
#   bash scripts/bench_master_dtype.sh OUTDIR
# 1b alternating (A B B A), then the Hugging Face Llama shape; one JSON-lines file per preset.
set -uo pipefail
OUT=${1:?usage: bench_master_dtype.sh OUTDIR}
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash scripts/device_setup.sh true || exit 1
export PYTHONPATH=/tmp/site
mkdir -p "$OUT"
run() {
  local preset=$1
  shift
  timeout 150 torchrun --standalone --nproc-per-node 1 benches/step.py --preset "$preset" \
    --warmup 5 --steps 15 --out "$OUT/$preset.jsonl" "$@" || echo "$preset $* failed: rc=$?"
}
BF16=(--master-dtype bf16 --reduce-dtype bf16 --tag bf16master)
run 1b --systems zrs_captured "${BF16[@]}"
run 1b --systems single
run 1b --systems single
run 1b --systems zrs_captured "${BF16[@]}"
run hf_llama_1b --systems zrs_captured "${BF16[@]}"
run hf_llama_1b --systems single
for preset in 1b hf_llama_1b; do python3 benches/step.py --table "$OUT/$preset.jsonl"; done
