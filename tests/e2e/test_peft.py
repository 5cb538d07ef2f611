"""PEFT adapters on a sharded model, on CPU ranks: LoRA on the attention and MLP projections of a
tiny Llama whose base is frozen in bf16 (QLoRA's layout without the quantisation: the adapters
stay fp32), under zrs.shard and zrs.compile, trains as the unsharded model does with the
per-rank gradients averaged; the base does not move; `save_pretrained` of the adapter, called on
every rank, writes the full adapter (only its entries gathered), from whichever rank
`is_main_process` names, and PEFT loads it into a fresh model; called on one rank alone it
raises ZrsError there instead of waiting in a gather; `load_adapter` into a sharded model loads
the saved adapter, and adapters added to an already sharded base are refused at the optimizer's
step (tests/support/library_runs.py runs it;
tests/gpu/test_libraries_gpu.py on NCCL)."""

from __future__ import annotations

import functools
import tempfile

import pytest

from _dist import cached_run
from library_runs import (
    check_adapter_files,
    check_alone,
    check_load_adapter,
    check_peft_training,
    peft_runs,
)

pytest.importorskip("peft")
pytestmark = [
    pytest.mark.slow,
    # peft 0.21's get_peft_model asks transformers 5.24 the deprecated is_gradient_checkpointing
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

PATHS = {2: ("shard", "compile"), 3: ("shard",)}
RTOL, ATOL = 1e-5, 1e-6


@functools.cache
def _group(world: int) -> list[dict]:
    root = tempfile.mkdtemp(prefix="zrs-peft-")
    return cached_run(("peft", world), peft_runs, world, root, PATHS[world], "cpu", timeout=300)


CASES = [
    pytest.param(world, path, id=f"w{world}-{path}")
    for world, paths in PATHS.items()
    for path in paths
]


@pytest.mark.parametrize(("world", "path"), CASES)
def test_adapters_train_as_the_unsharded_model_and_the_base_stays(world, path):
    check_peft_training(_group(world)[0], path, RTOL, ATOL)


@pytest.mark.parametrize(("world", "path"), CASES)
def test_save_pretrained_writes_the_full_adapter_that_peft_loads(world, path):
    check_adapter_files(_group(world)[0][path])


@pytest.mark.parametrize("world", sorted(PATHS))
def test_save_pretrained_on_one_rank_alone_raises(world):
    check_alone(_group(world)[0])


@pytest.mark.parametrize("world", sorted(PATHS))
def test_load_adapter_into_a_sharded_model_and_adapters_added_after_sharding(world):
    check_load_adapter(_group(world)[0], PATHS[world][0])
