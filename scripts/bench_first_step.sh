#!/usr/bin/env bash
# Time to the first trained step and step time of zrs.shard against FSDP2 eager, one process per
# run, alternating (A B B A A B) so that neither system always meets the machine's caches first:
#   bash scripts/bench_first_step.sh OUT.jsonl [PRESET...]      (default presets: 1b hf_llama_1b)
# on the device machine, with the zrs wheel carried in .whl/ (scripts/device_setup.sh).
# MODES="nopyc pyc" (default) picks the rounds below; REPEATS=N runs the six N times.
#
# Two rounds: "nopyc" as the device machine is (PYTHONDONTWRITEBYTECODE=1: every process compiles
# every imported module's source), then "pyc" with cached bytecode, as on a user's machine.
# After each run it prints the size of the driver's JIT cache (~/.nv/ComputeCache): the first run
# of each shape on a fresh machine fills it (cuDNN's runtime-compiled attention kernels), whatever
# the system.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench_first_step.sh OUT.jsonl [PRESET...]}
shift
if [ $# -gt 0 ]; then presets=("$@"); else presets=(1b hf_llama_1b); fi
bash scripts/device_setup.sh true 2>&1 | tail -1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
warm_files() {
  python3 -c "import torch, transformers, torch._dynamo, torch.distributed.fsdp, torch.distributed.tensor, zrs"
}
one() {  # preset system tag
  timeout 120 torchrun --standalone --nproc-per-node 1 benches/step.py --preset "$1" --systems "$2" \
    --warmup 3 --steps 8 --tag "$3" --out "$out" 2>&1 | grep -E "^\| $1 \||Error" | head -3 || true
  echo "   driver JIT cache: $(du -sk ~/.nv/ComputeCache 2>/dev/null | cut -f1) KiB"
}
warm_files
for mode in ${MODES:-nopyc pyc}; do
  if [ "$mode" = pyc ]; then
    unset PYTHONDONTWRITEBYTECODE
    export PYTHONPYCACHEPREFIX=/tmp/pyc
    warm_files
  fi
  for preset in "${presets[@]}"; do
    for _ in $(seq "${REPEATS:-1}"); do
      for system in fsdp2_eager zrs_eager zrs_eager fsdp2_eager fsdp2_eager zrs_eager; do
        one "$preset" "$system" "$mode"
      done
    done
  done
done
