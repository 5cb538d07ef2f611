"""The main job: train a small byte-level GPT on the bundled corpus with zrs ZeRO-3.

    python -m zrs.train [--steps N] [--nproc N] [--model-size S] [--out DIR] ...
    python -m zrs.train --save-every 100            # checkpoints in OUT/checkpoint-STEP
    python -m zrs.train --resume out/checkpoint-100  # go on from there, at any world size

Run directly, it launches ``--nproc`` workers through torch.distributed's elastic launcher, as
``torchrun --standalone`` does (and prints that torchrun line). Run under torchrun (RANK,
WORLD_SIZE and LOCAL_RANK set), it is one worker. With GPUs it uses NCCL and one GPU per rank;
otherwise gloo on CPU, splitting the cores between the ranks.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import shlex
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import zrs
from zrs.train.data import BatchSampler, decode, encode, load_corpus
from zrs.train.gpt import GPT, PRESETS, config_for

DEFAULT_STEPS = 300


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m zrs.train",
        description="Train a small GPT on the bundled corpus, ZeRO-3-sharded by zrs.",
    )
    p.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps (default: %(default)s)"
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks to launch (default: every GPU, else 2 CPU ranks); ignored under torchrun",
    )
    p.add_argument(
        "--model-size",
        choices=sorted(PRESETS),
        default="small",
        help="GPT preset (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("out"),
        help="where model.pt and summary.json go (default: ./out)",
    )
    p.add_argument(
        "--lr", type=float, default=3e-3, help="peak AdamW learning rate (default: %(default)s)"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="sequences per rank per step (default: %(default)s)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (default: the preset's context)",
    )
    p.add_argument(
        "--backend",
        choices=["inductor", "eager"],
        default="inductor",
        help="zrs.compile backend, or torch.compile's for --compile layers (default: %(default)s)",
    )
    p.add_argument(
        "--compile",
        choices=["model", "layers"],
        default="model",
        help="model: zrs.compile, the whole step one planned graph (the shortest step); layers: "
        "zrs.shard(compile=BACKEND), each layer compiled on its own (the shortest first step) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the weights and the batches (default: %(default)s)",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=0,
        metavar="N",
        help="write a checkpoint (torch.distributed.checkpoint) to OUT/checkpoint-STEP every N "
        "steps and after the last (default: never)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="start from this checkpoint: weights, optimizer, schedule and step (any world size)",
    )
    args = p.parse_args(argv)
    if args.save_every < 0:
        p.error("--save-every must be 0 (never) or positive")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.nproc is not None and args.nproc < 1:
        p.error("--nproc must be at least 1")
    return args


def lr_at(step: int, steps: int) -> float:
    """Multiplier of the peak learning rate: linear warmup, then cosine decay to 10%."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker(args: argparse.Namespace) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, _cpu_count() // local_world))
        dist.init_process_group("gloo")
    try:
        if rank == 0:  # what zrs is compiling, printed above the progress bar
            zrs_log = logging.getLogger("zrs")
            zrs_log.setLevel(logging.INFO)
            with logging_redirect_tqdm(loggers=[zrs_log]):
                _train(args, rank, world, device)
        else:
            _train(args, rank, world, device)
    finally:
        dist.destroy_process_group()


def _train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
    preset = PRESETS[args.model_size]
    seq_len = args.seq_len or preset.block_size
    cfg = config_for(args.model_size, block_size=max(preset.block_size, seq_len))
    log = tqdm.write if rank == 0 else (lambda *_: None)

    # Build on the meta device: zrs materialises each module shard by shard through its
    # reset_parameters(), in the order GPT.init_weights uses, so the seed fixes the weights.
    with torch.device("meta"):
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    torch.manual_seed(args.seed)
    if args.compile == "layers":
        model = zrs.shard(model, compile=args.backend)
    else:
        model = zrs.compile(model, backend=args.backend)
    log(
        f"zrs.train: GPT-{args.model_size} ({n_params / 1e6:.2f}M params, {cfg.n_layer} layers, "
        f"d_model {cfg.d_model}) sharded over {world} rank(s) on {device.type}, "
        f"{dist.get_backend()}, compile={args.compile}, backend={args.backend}; "
        f"{args.batch_size} x {seq_len} tokens "
        f"per rank per step"
    )

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, args.steps))
    sampler = BatchSampler(
        load_corpus("train"), args.batch_size, seq_len, rank=rank, seed=args.seed
    )

    losses: list[float] = []
    start = 0
    if args.resume is not None:
        extra = zrs.checkpoint.load(args.resume, model, opt)
        start, losses = extra["step"], list(extra["losses"])
        sched.load_state_dict(extra["scheduler"])
        log(f"zrs.train: resumed from {args.resume} at step {start}")
    saving = None  # the last asynchronous save, finished before the next one starts
    first_step_s = 0.0
    bar = tqdm(
        range(start, args.steps),
        desc="train",
        unit="step",
        disable=rank != 0,
        file=sys.stdout,
        initial=start,
        total=args.steps,
    )
    t0 = time.perf_counter()
    for step in bar:
        x, y = (t.to(device, non_blocking=True) for t in sampler.batch(step))
        loss = model(x, y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the mean over ranks (gloo has no ReduceOp.AVG)
        losses.append(mean.item() / world)
        if step == start:
            first_step_s = time.perf_counter() - t0
            # The compile left ~1e6 objects alive that every full collection would scan again
            # (seconds at a large model, README); collect once and keep them out of the scans.
            gc.collect()
            gc.freeze()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{sched.get_last_lr()[0]:.1e}")
        done = step + 1
        if args.save_every and (done % args.save_every == 0 or done == args.steps):
            if saving is not None:
                saving.result()
            extra = {"step": done, "losses": losses, "scheduler": sched.state_dict()}
            where = args.out / f"checkpoint-{done}"
            saving = zrs.checkpoint.save(where, model, opt, extra=extra, async_save=True)
            log(f"zrs.train: saving {where}")
    if saving is not None:
        saving.result()
    wall_s = time.perf_counter() - t0
    bar.close()

    state = zrs.full_state_dict(model)  # collective: every rank takes part
    if rank != 0:
        return
    summary = {
        "steps": args.steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "wall_s": round(wall_s, 2),
        "world_size": world,
        "first_step_s": round(first_step_s, 2),
        "step_s_after_first": round((wall_s - first_step_s) / max(1, args.steps - start - 1), 4),
        "resumed_from": str(args.resume) if args.resume is not None else None,
        **_evaluate(cfg, state, device, seq_len, args.seed),
        "model_size": args.model_size,
        "n_params": n_params,
        "device": device.type,
        "backend": args.backend,
        "compile": args.compile,
        "batch_size": args.batch_size,
        "seq_len": seq_len,
        "lr": args.lr,
        "seed": args.seed,
        "config": cfg.__dict__,
        "losses": [round(v, 4) for v in losses],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in state.items()}, args.out / "model.pt")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(
        f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} "
        f"(val {summary['val_loss']:.3f}) in {args.steps} steps, {wall_s:.1f} s "
        f"(first step {first_step_s:.1f} s, then {summary['step_s_after_first'] * 1e3:.0f} ms/step)"
    )
    log(f"sample: {summary['sample']!r}")
    log(f"wrote {args.out / 'model.pt'} and {args.out / 'summary.json'}")


def _evaluate(cfg, state: dict, device: torch.device, seq_len: int, seed: int) -> dict:
    """Validation loss and a text sample from the gathered weights in a plain, unsharded GPT."""
    model = GPT(cfg).to(device).eval()
    model.load_state_dict(state)
    sampler = BatchSampler(load_corpus("val"), 16, seq_len, seed=seed)
    with torch.no_grad():
        val = [model(*(t.to(device) for t in sampler.batch(i))).item() for i in range(4)]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        prompt = encode("Alice ").to(device)[None]
        sample = decode(model.generate(prompt, 120)[0].cpu())
    return {"val_loss": sum(val) / len(val), "sample": sample}


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def launch(args: argparse.Namespace, argv: list[str]) -> None:
    """Start ``nproc`` workers on this machine, as ``torchrun --standalone`` does."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = args.nproc or gpus or 2
    if gpus and nproc > gpus:
        sys.exit(f"zrs.train: --nproc {nproc} but only {gpus} GPU(s); each rank needs its own GPU")
    if not gpus:  # CPU: split the cores between the ranks
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cpu_count() // nproc)))
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", "zrs.train", *argv]
    print(f"zrs.train: launching {nproc} rank(s); the same as:\n  {shlex.join(cmd)}", flush=True)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "zrs.train", *argv)
    except ChildFailedError as e:
        print(f"zrs.train: a worker failed\n{e}", file=sys.stderr)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if _under_torchrun():
        worker(args)
    else:
        launch(args, argv)


if __name__ == "__main__":
    main()
