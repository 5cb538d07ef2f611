"""Checkpoints of a sharded model and its optimizer, through torch.distributed.checkpoint (DCP).

The parameters are DTensors, so PyTorch's own recipe works unchanged (`get_state_dict`,
`dcp.save`, in new processes `dcp.load`, `set_state_dict`), at any world size. `save` and `load`
are that recipe plus what a long job needs on the way back in:

* the checkpoint is checked before anything is read: its metadata, every key and shape the
  model and optimizer expect, and every data file's length. A mismatched or truncated
  checkpoint raises ZrsError naming the file and the first bad key;
* the tensors are read into fresh buffers and copied into the model and optimizer only once
  all of them were read: a file that fails to load (corrupt) leaves both as they were. This
  holds a second copy of the model and optimizer state while loading.

DCP keeps no checksums: bytes flipped inside a tensor's data are not detected.
"""

from __future__ import annotations

import os
import pickle
import warnings
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from zrs._core import ZrsError
from zrs.runtime.collectives import new_group_like
from zrs.runtime.state import ZeroState

_EXTRA = "zrs_extra"  # the key of save()'s `extra`


def _state(model: nn.Module) -> ZeroState:
    state = getattr(model, "_zrs_state", None)
    if state is None:
        raise ZrsError("zrs.checkpoint needs the model returned by zrs.compile")
    return state


def _state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: bool
) -> dict[str, Any]:
    if optimizer is None:
        if not weights:
            raise ZrsError("zrs.checkpoint with weights=False saves an optimizer: pass one")
        return {"model": get_model_state_dict(model)}
    if not weights:  # the model only names the optimizer's parameters
        return {"optim": get_optimizer_state_dict(model, optimizer)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save(
    checkpoint_id: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    async_save: bool = False,
    weights: bool = True,
) -> Future | None:
    """Save `model` (and `optimizer`'s state) to the directory `checkpoint_id` with DCP.

    Collective: every rank calls it. Each rank writes its own rows; keys are the model's own
    parameter names. `extra` holds small picklable values (the step, a data position), written
    once. `async_save`: stage to CPU and write in the background (`dcp.async_save`); returns
    the future to wait on before the next save. `weights=False`: the optimizer's state alone,
    for libraries that keep the model's weights and the optimizer's in checkpoints of their own.
    """
    state = _state(model)
    state.check_usable()  # after a failed collective the peers may be gone: no save can finish
    content = _state_dict(model, optimizer, weights)
    if extra is not None:
        # One pickled value, written once: DCP would split nested dicts and lists into keys.
        content[_EXTRA] = pickle.dumps(dict(extra))
    # A folder saved again is written over, as torch.save writes over a file: DCP's default
    # today, asked for by name, so that its warning that the default will change says nothing.
    writer = dcp.FileSystemWriter(checkpoint_id, overwrite=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected an existing checkpoint", UserWarning)
        if not async_save:
            dcp.save(content, storage_writer=writer, process_group=state.job_group)
            return None
        return dcp.async_save(content, storage_writer=writer, process_group=_cpu_group(state))


def _cpu_group(state: ZeroState) -> dist.ProcessGroup | None:
    """A gloo group of its own over the state's ranks for asynchronous saves (made once per
    state): their writes and their final collective run in a background thread, which must not
    share a communicator with the training's collectives (gloo pairs them in issue order)."""
    if state.job_group is None:
        return None
    if state.checkpoint_group is None:
        state.checkpoint_group = new_group_like(state.job_group, state.timeout, backend="gloo")
    return state.checkpoint_group


def load(
    checkpoint_id: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    weights: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by `save` (or by the DCP recipe, keys "model" and "optim") into
    `model` and `optimizer`, at this world size, whatever the saving one. Returns `extra`.
    `weights=False`: the optimizer's state alone (a checkpoint saved with `weights=False`).

    Collective: every rank calls it. Raises ZrsError, leaving the model and optimizer as they
    were, when the checkpoint does not match them or cannot be read.
    """
    state = _state(model)
    state.check_usable()
    path = os.fspath(checkpoint_id)
    target = _state_dict(model, optimizer, weights)
    metadata = _read_metadata(path)
    if _EXTRA in metadata.state_dict_metadata:
        target[_EXTRA] = b""
    _check_against(path, metadata, target)
    _check_files(path, metadata)
    staged = tree_map_only(torch.Tensor, _fresh, target)
    try:
        dcp.load(staged, checkpoint_id=path, process_group=state.job_group)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        key = _first_unreadable(path, staged, state)
        where = _files_of(path, metadata, key) if key is not None else "its data files"
        raise ZrsError(
            f"checkpoint {path}: cannot read {key!r} from {where} ({type(exc).__name__}); the "
            "model and optimizer were left as they were"
        ) from exc
    if optimizer is None:
        set_model_state_dict(model, staged["model"])
    elif not weights:
        set_optimizer_state_dict(model, optimizer, staged["optim"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=staged["model"], optim_state_dict=staged["optim"]
        )
    return pickle.loads(staged[_EXTRA]) if _EXTRA in staged else {}


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t) if isinstance(t, DTensor) else t.detach().clone()


def _read_metadata(path: str) -> Metadata:
    file = os.path.join(path, ".metadata")
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise ZrsError(
            f"checkpoint {path}: cannot read its metadata {file} ({type(exc).__name__}: {exc}); "
            "it is missing or damaged (a save that did not finish writes none)"
        ) from exc


def _flat(content: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """DCP's flattened keys: nested dicts joined with dots (lists by index)."""
    out: dict[str, Any] = {}
    items = content.items() if isinstance(content, dict) else enumerate(content)
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, dict | list) and not isinstance(v, torch.Tensor):
            out.update(_flat(v, f"{key}."))
        else:
            out[key] = v
    return out


def _check_against(path: str, metadata: Metadata, target: dict[str, Any]) -> None:
    saved = metadata.state_dict_metadata
    for key, value in _flat(target).items():
        if not isinstance(value, torch.Tensor):
            continue
        meta = saved.get(key)
        if meta is None:
            raise ZrsError(
                f"checkpoint {path} has no {key!r}: it was saved from another model or "
                "optimizer (the first key it lacks)"
            )
        if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != tuple(value.shape):
            got = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "no tensor"
            raise ZrsError(
                f"checkpoint {path}: {key!r} has shape {got} there and {tuple(value.shape)} "
                "here: it was saved from another model configuration"
            )
        if meta.properties.dtype != value.dtype:
            raise ZrsError(
                f"checkpoint {path}: {key!r} is {meta.properties.dtype} there and {value.dtype} "
                "here"
            )


def _check_files(path: str, metadata: Metadata) -> None:
    """Every data file exists and is long enough for what the metadata says it holds."""
    need: dict[str, tuple[int, str]] = {}  # file -> (bytes needed, a key stored at the end)
    for index, info in (metadata.storage_data or {}).items():
        end = info.offset + info.length
        if end > need.get(info.relative_path, (-1, ""))[0]:
            need[info.relative_path] = (end, index.fqn)
    for name, (end, key) in sorted(need.items()):
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.exists(file) else None
        if size is None or size < end:
            what = "is missing" if size is None else f"has {size} bytes of {end}"
            raise ZrsError(
                f"checkpoint {path}: data file {file} {what} (truncated: {key!r} is cut off); "
                "the model and optimizer were left as they were"
            )


def _first_unreadable(path: str, staged: dict[str, Any], state: ZeroState) -> str | None:
    """After a failed load: the first key that cannot be read on its own (collective)."""
    for key, value in _flat(staged).items():
        try:
            dcp.load({key: value}, checkpoint_id=path, process_group=state.job_group)
        except (Exception, CheckpointException):
            return key
    return None


def _files_of(path: str, metadata: Metadata, key: str) -> str:
    files = sorted(
        {
            os.path.join(path, info.relative_path)
            for index, info in metadata.storage_data.items()
            if index.fqn == key
        }
    )
    return ", ".join(files) or "its data files"
