"""Training-step benchmark: zrs against the systems users would pick instead.

Runs under torchrun, one process per GPU, on any number of GPUs (or on the CPU with gloo, for
development; a plain ``python benches/step.py`` is one process, world 1). For each system in
``--systems`` it builds the model of ``--preset``, trains ``--warmup`` steps and then ``--steps``
timed steps with AdamW on random tokens, and prints one JSON line (appended to ``--out`` too):

    torchrun --standalone --nproc-per-node 2 benches/step.py --preset 1b --systems zrs \\
        --out benches/results/h200x2.jsonl
    python benches/step.py --table benches/results/h200x2.jsonl   # Markdown table of a file

Presets:
  1b, 7b, tiny     the Llama-style model of benches/llama.py (loss: cross-entropy of fp32 logits)
  hf_llama_1b      transformers LlamaForCausalLM, TinyLlama-1.1B shape (22 layers, hidden 2048,
                   32 heads, 4 KV heads); seq 2048, micro-batch 4
  hf_gpt2_xl       transformers GPT2LMHeadModel, GPT-2 XL shape (48 layers, 1600, 25 heads, tied
                   head); seq 1024, micro-batch 4
  hf_llama_tiny, hf_gpt2_tiny   2 layers, dim 64: CPU smoke tests
The hf_* models (benches/hf_models.py) are built from configs (nothing is downloaded) with
attn_implementation="sdpa", no dropout, and train on their own loss,
``model(input_ids=x, labels=x).loss``; FSDP2 shards (and fsdp2_compile compiles) each
LlamaDecoderLayer / GPT2Block and the root.

--varlen: step i on rank r uses the first L tokens of its batch, L uniform in
[seq_len // 16, seq_len], drawn from (--seed, r, i), so ranks differ within a step and runs repeat.
zrs relies on zrs.compile's dynamic shapes at several ranks; at world 1, and for the other
compiled systems, torch.compile recompiles once and then treats the length as dynamic; the eager
ones (zrs_eager, fsdp2_eager, deepspeed_zero3) compile nothing.

Systems:
  zrs              zrs.compile(model, param_dtype=bf16, reduce_dtype=fp32)
  zrs_graphed      the same, its fused AdamW step replayed as a CUDA graph (zrs.GraphedStep)
  zrs_captured     the same, the whole step (forward, backward, AdamW) one CUDA graph
                   (zrs.CapturedStep; one rank)
  zrs_eager        zrs.shard(model, param_dtype=bf16, reduce_dtype=fp32): the same sharding, no
                   torch.compile (module hooks gather, prefetch and release); --zrs-* don't apply
  zrs_shard_compile
                   the same with each layer's forward compiled by inductor, and the root's
                   code around the layers (embedding, head, loss), zrs.shard(model, compile=True)
  zrs_shard_compile_layers
                   the layers only, compile_root=False: FSDP2 + compile's split of the work
  zrs_offload      the same with offload="optimizer": fp32 masters and AdamW on the host
  zrs_offload_overlap
                   the same, its AdamW updates run during the backward (zrs.OverlappedStep)
  zrs_params_overlap
                   the same with offload="params": the bf16 shards on the host too
  fsdp2_eager      fully_shard per block and on the root, MixedPrecisionPolicy(bf16, fp32)
  fsdp2_compile    the same with each block torch.compile'd (fullgraph), as torchtitan does
  single           one GPU (rank 0 only), unsharded bf16 parameters, whole model compiled: the
                   compute-only bound
  single_amp       as single, but fp32 parameters under torch.autocast to --param-dtype: the same
                   mixed-precision recipe as the sharded systems (fp32 master weights, optimizer
                   and gradients), the bound that the sharding alone is measured against
  deepspeed_zero3  DeepSpeed ZeRO-3, eager, bf16 (only when deepspeed imports)
  deepspeed_offload
                   the same with offload_optimizer on the CPU (its CPUAdam)
  deepcompile      DeepSpeed ZeRO-3 with DeepCompile: "compile": {"deepcompile": true} and
                   engine.compile() (at least 8 warm-up steps; its passes run at step 5)

Each system gets its own process group, created before it is built and destroyed after it. An
exception is caught and reported as a JSON line with "error"; the next system still runs. Run one
system per torchrun invocation (scripts/bench_device.sh does) to isolate crashes and hangs as well,
and always for the DeepSpeed systems, which keep process-global state.

Metrics (times are the maximum over ranks, step by step):
  step_ms_med / step_ms_min   median / minimum of the timed steps (CUDA events on GPUs);
                              step_ms_each: every timed step; step_ms_mean_wall: the host's
                              wall time over the timed steps, per step
  tok_s_gpu                   micro_batch * seq_len / median step (--varlen too: nominal)
  mfu                         flops_per_token * tokens / (median step * --peak-tflops); flops per
                              token = 6 * (parameters less the input embeddings; a tied head
                              counted) + 12 * layers * dim * seq: approximate (no causal saving,
                              no elementwise ops)
  tok_s_gpu_real, mfu_real    (--varlen) over the tokens really processed: micro_batch * the sum
                              of the timed steps' lengths over all ranks / world / the sum of the
                              step times (mfu_real: attention term at each step's length);
                              tok_s_gpu_real_med: the median of the per-step rates. With
                              "varlen": true, seq_len_mean (timed steps), distinct_lengths (over
                              warm-up and timed steps and all ranks), varlen_range and
                              timed_compiles (graphs dynamo compiled during the timed steps, max
                              over ranks: 0 unless a new length recompiled there)
  peak_GiB                    torch.cuda.max_memory_allocated over the timed steps (max over ranks);
                              peak_GiB_all over the whole system's run (build and warm-up included).
                              zrs_captured: peak_GiB_all (a replay allocates nothing; its graph's
                              memory is allocated at the capture)
  warmup_s                    wall time from the start of the model build to the end of the first
                              trained step (compilation included); build_s to the end of the
                              build (the library's import included); warmup_total_s to the end of
                              all warm-up steps; compile_phases_s: torch's own compile timers
                              (dynamo_timed, summed over graphs) that took at least 0.5 s;
                              compile_graphs: each graph's own (id, function, FX nodes, the
                              forward's and the backward's compile seconds, their codegen and
                              Triton builds)
  first_step_gc_s             rank 0's garbage collector over the build and first step: young_s
                              (generations 0 and 1), full_s and full_collections (generation 2)
  gc                          --gc: "freeze" (the collector ran once after the warm-up and froze
                              what was alive) or "auto"
  zrs_kernels                 (zrs systems on CUDA) the copy kernels' status when the timed steps
                              began, after waiting for their background build: "loaded", or
                              "failed"/"disabled" (the torch ops ran)
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
from pathlib import Path

import torch

from harness.run import worker
from harness.table import read_records, table
from systems import ALL_SYSTEMS, default_systems
from systems.common import ALL_PRESETS, DTYPES
from systems.deepspeed import DEEPSPEED_SYSTEMS

# The systems are benches/systems/ (one family a module: their builders and registry pieces),
# the harness that runs them benches/harness/ (processes, measurement, profiles, the table).


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Run under torchrun; see benches/README.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        choices=ALL_PRESETS,
        default="1b",
        help="model (default 1b): benches/llama.py's, or a transformers model (hf_*, "
        "benches/hf_models.py)",
    )
    p.add_argument(
        "--systems",
        nargs="+",
        default=None,
        help=f"from {','.join(ALL_SYSTEMS)}, comma- or space-separated (default: all available: "
        "the DeepSpeed ones only when deepspeed imports)",
    )
    p.add_argument("--warmup", type=int, default=10, help="untimed steps (default 10; >= 8 for "
                   "deepcompile, raised there if lower)")  # fmt: skip
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--tag", default="", help='label of the run, e.g. "" or "nop2p"')
    p.add_argument("--out", type=Path, help="append the JSON lines to this file")
    p.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="cuda (NCCL, one GPU per rank) or cpu (gloo); default cuda when available",
    )
    p.add_argument("--micro-batch", type=int, help="sequences per rank per step (preset's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    p.add_argument(
        "--varlen",
        action="store_true",
        help="variable-length batches: each step and rank draws its length uniformly from "
        "[seq_len // 16, seq_len] (seeded by --seed, the step and the rank)",
    )
    p.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument(
        "--reduce-dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="gradient reduce-scatter dtype of zrs and FSDP2 (DeepSpeed reduces in its "
        "bf16 default)",
    )
    p.add_argument(
        "--master-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="what zrs and FSDP2 keep their sharded parameters and optimizer state in: fp32 "
        "(default; master weights, single_amp's recipe) or bf16 (none, single's recipe: with "
        "--reduce-dtype bf16 they train what single trains)",
    )
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="dense bf16 peak per device for MFU (default 989: H100/H200 SXM)",
    )
    p.add_argument(
        "--zrs-backend",
        choices=["inductor", "eager"],
        default="inductor",
        help="zrs.compile backend",
    )
    p.add_argument(
        "--zrs-scheduler",
        choices=["search", "greedy", "none"],
        default="search",
        help="zrs.compile scheduler (default search)",
    )
    p.add_argument(
        "--zrs-no-regions",
        action="store_true",
        help="zrs.compile(regions=False): trace every layer on its own",
    )
    p.add_argument(
        "--zrs-dynamic",
        action="store_true",
        help="zrs.compile(dynamic=True): symbolic sizes from the first compile (the default at "
        "several ranks; at world 1 torch.compile's static-first)",
    )
    p.add_argument(
        "--zrs-mesh",
        metavar="RxS",
        help="zrs's mesh=: a 2-D DeviceMesh of R replicas of S shards (hybrid sharding); "
        "default: the world group",
    )
    p.add_argument(
        "--zrs-shared-reduce-communicator",
        action="store_true",
        help="zrs.compile(separate_reduce_communicator=False): gathers and reduce-scatters on "
        "one NCCL communicator",
    )
    p.add_argument(
        "--zrs-reduces-in-flight",
        type=int,
        metavar="N",
        help="zrs's gradient reduce-scatters in flight at most (zrs.runtime.grads."
        "MAX_IN_FLIGHT_REDUCES, default 2): an experiment's knob, not an option of zrs",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of single and fsdp2_compile (default inductor; aot_eager "
        "for quick CPU smoke tests)",
    )
    p.add_argument(
        "--ds-init",
        choices=["zero_init", "full"],
        default="zero_init",
        help="DeepSpeed model construction: under deepspeed.zero.Init (default) or full on the GPU",
    )
    p.add_argument(
        "--no-cudnn-sdpa",
        action="store_true",
        help="torch.backends.cuda.enable_cudnn_sdp(False): SDPA takes flash attention. cuDNN's "
        "attention builds a plan per new shape on the host (~0.5 s per new length at 1b)",
    )
    p.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="after the timed steps, profile 3 more with torch.profiler: Chrome traces per rank "
        "in DIR and the ops with the most device time per step in the record",
    )
    p.add_argument(
        "--host-profile",
        type=Path,
        metavar="DIR",
        help="after the timed steps, run 3 more under cProfile: the raw profile per rank in DIR "
        "(read it with pstats) and the functions with the most host time per step in the record",
    )
    p.add_argument(
        "--first-profile",
        type=Path,
        metavar="DIR",
        help="sample the build's and the first step's Python stacks: collapsed stacks per rank in DIR "
        "and the functions with the most host time in the record (first_profile)",
    )
    p.add_argument(
        "--memory",
        type=Path,
        metavar="DIR",
        help="(CUDA) after the timed steps, record the allocator's history for one more step: a "
        "snapshot per rank in DIR and what is live at the peak in the record (memory_peak.py)",
    )
    p.add_argument(
        "--gc",
        choices=["freeze", "auto"],
        default="freeze",
        help="Python's garbage collector in the timed steps, every system alike: 'freeze' "
        "(default) collects once after the warm-up and freezes what is alive (the compiled "
        "code), as README's training loop does; 'auto' leaves it as is, when a full collection "
        "scans every object a compile left (0.3-1.3 s each, GPT-2 XL)",
    )
    p.add_argument("--pg-timeout", type=float, default=1800, help="process-group timeout, seconds")
    p.add_argument("--command", help=argparse.SUPPRESS)  # the launching command, for the record
    p.add_argument("--table", type=Path, metavar="FILE", help="print a Markdown table of FILE")
    args = p.parse_args(argv)
    if args.table is None:
        systems = (
            [s for arg in args.systems for s in arg.split(",") if s]
            if args.systems
            else default_systems()
        )
        unknown = [s for s in systems if s not in ALL_SYSTEMS]
        if unknown:
            p.error(f"unknown system(s) {','.join(unknown)}; choose from {','.join(ALL_SYSTEMS)}")
        args.systems = systems
        if args.warmup < 1 or args.steps < 1:
            p.error("--warmup and --steps must be at least 1")
        if args.master_dtype != "fp32" and set(systems) & set(DEEPSPEED_SYSTEMS):
            p.error("--master-dtype bf16: the DeepSpeed systems keep fp32 master weights")
    return args


def main(argv: list[str] | None = None) -> None:
    # `kill -USR1 <pid>` prints every thread's stack: where a hung rank waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = parse_args(argv)
    if args.table is not None:
        print(table(read_records(args.table)))
        return
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    worker(args)


if __name__ == "__main__":
    main()
