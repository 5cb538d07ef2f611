"""Hugging Face's Trainer with a zrs model against Trainer with FSDP2 (Accelerate's FSDP2 plugin),
step time and peak memory (issue 36). One system per torchrun:

  torchrun --nproc-per-node 2 benches/trainer_step.py --preset hf_llama_1b --system zrs \\
      --out benches/results/trainer.jsonl

Systems: ``zrs`` (``zrs.trainers.hf.Trainer`` on ``zrs.shard(model, compile=True)``, bf16
compute and fp32 reduce as ``zrs_shard_compile`` in benches/step.py), ``zrs_eager`` (the same
without compiled layers), ``fsdp2`` (transformers' Trainer with ``fsdp="full_shard"`` and
``fsdp_version: 2``, each decoder layer a unit, bf16 mixed precision), ``fsdp2_compile`` (the
same with Trainer's ``torch_compile=True``: the whole model under ``torch.compile``). All train the same model
(benches/hf_models.py) on the same random tokens with Trainer's AdamW, ``--warmup`` steps and
then ``--steps`` timed ones, each timed from Trainer's ``on_step_begin`` to ``on_step_end`` with
the device synchronised at both. On the CPU (gloo, the tiny presets) it only checks that both
run. One JSON line per run, written by rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_models

SYSTEMS = ("zrs", "zrs_eager", "fsdp2", "fsdp2_compile")


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timer():
    import transformers

    class StepTimer(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.ms: list[float] = []
            self.start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            _sync()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync()
            self.ms.append(1e3 * (time.perf_counter() - self.start))

    return StepTimer()


def _arguments(args, out_dir: str, system: str):
    import transformers

    cuda = torch.cuda.is_available()
    extra = {}
    if system.startswith("fsdp2"):
        extra = {
            "torch_compile": system == "fsdp2_compile",
            "fsdp": "full_shard",
            "fsdp_config": {
                "fsdp_version": 2,
                "reshard_after_forward": True,
                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "transformer_layer_cls_to_wrap": [args.layer_class],
            },
        }
    return transformers.TrainingArguments(
        output_dir=out_dir,
        max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.micro_batch,
        learning_rate=1e-4,
        bf16=cuda,  # CPU: fp32, a smoke run only
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=not cuda,
        dataloader_num_workers=0,
        seed=0,
        **extra,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="hf_llama_tiny", choices=sorted(hf_models.HF_PRESETS))
    ap.add_argument("--system", required=True, choices=SYSTEMS)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    p = hf_models.HF_PRESETS[args.preset]
    args.micro_batch = p.micro_batch
    torch.manual_seed(0)
    model = hf_models.build(p, hf_models.hf_config(p))
    args.layer_class = type(hf_models.blocks(model)[0]).__name__
    started = time.perf_counter()
    timer = _timer()
    world = dist.get_world_size()
    data = _Rows(p.micro_batch * world * (args.warmup + args.steps), p.seq_len, p.vocab_size)
    with tempfile.TemporaryDirectory() as out_dir:
        training = _arguments(args, out_dir, args.system)
        if args.system.startswith("zrs"):
            import zrs
            from zrs.trainers.hf import Trainer

            model = zrs.shard(
                model.to("cuda") if cuda else model,
                param_dtype=torch.bfloat16 if cuda else None,
                reduce_dtype=torch.float32,
                compile=args.system == "zrs",
            )
        else:
            from transformers import Trainer
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[timer])
        result = trainer.train()
    timed = timer.ms[args.warmup :]
    record = {
        "system": f"trainer_{args.system}",
        "preset": args.preset,
        "world": world,
        "step_ms_med": round(statistics.median(timed), 2) if timed else None,
        "step_ms_min": round(min(timed), 2) if timed else None,
        "step_ms_each": [round(t, 1) for t in timer.ms],
        "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "first_steps_s": round(sum(timer.ms[: args.warmup]) / 1e3, 2),
        "loss": round(result.training_loss, 4),
        "wrapped_as": type(trainer.model_wrapped).__name__,  # what Trainer trained: FSDP2, DDP, ...
        "total_s": round(time.perf_counter() - started, 2),
        "warmup_steps": args.warmup,
        "steps": args.steps,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
    }
    if dist.get_rank() == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        print(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
