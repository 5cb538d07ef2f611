"""Where a model will run and how its ranks talk, before it is sharded: the process group and
the device, the call's number, the communicators and the store meeting (`Links`), the agreement
on the model and its options across the ranks, and the model's `ZeroState` made from them."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zrs._core import Registry, ZrsError
from zrs.prepare.mesh import REPLICATE_DIM, SHARD_DIM, Topology, world_size
from zrs.prepare.options import Precision
from zrs.runtime.collectives import new_group_like
from zrs.runtime.exchange import Peers, group_timeout
from zrs.runtime.handles import LIVE
from zrs.runtime.offload import Offload
from zrs.runtime.state import ZeroState


def agree_and_connect(
    model: nn.Module, topology: Topology, api: str, settings: dict[str, Any]
) -> Links:
    """Find the model's device, number this call (every rank counts alike), agree on the model
    and `settings` across the ranks (every replica's too), and make the communicators."""
    device = resolve_device(model, topology.shard)
    settings = {**settings, "mesh": topology.describe()}
    links = Links(topology, device, settings["timeout"], next(LIVE.compile_calls))
    if links.peers is not None:  # before any collective: a mismatch there hangs or aborts
        links.peers.agree(f"{api} call {links.entry}", describe(model, settings))
        links.connect(settings.get("separate_reduce_communicator", True))
    return links


def make_state(
    links: Links, precision: Precision, offload: str | None = None, **state_options: Any
) -> ZeroState:
    """The model's state: its communicators, dtypes and planner options, and an empty registry;
    with `offload`, its host side (and a gloo group for the host tensors' mesh)."""
    group = links.group
    world = world_size(group)
    if offload is not None:
        state_options["offload"] = Offload(links.device, params=offload == "params")
        if links.topology.mesh is not None:
            raise ZrsError(
                "offload= with a 2-D mesh (hybrid sharding) is not supported yet: offload over "
                "a 1-D mesh or process_group, or shard over the 2-D mesh without offload"
            )
        if group is not None and links.control_group is None:  # one rank: no meeting made it
            links.control_group = new_group_like(group, links.timeout, backend="gloo")
    return ZeroState(
        group=group,
        world_size=world,
        rank=dist.get_rank(group) if group is not None else 0,
        device=links.device,
        param_dtype=precision.param,
        master_dtype=precision.master,
        reduce_dtype=precision.reduce,
        own_dtypes=precision.own,
        registry=Registry(world),
        timeout=links.timeout,
        gather_group=links.gather_group,
        reduce_group=links.reduce_group,
        control_group=links.control_group,
        peers=links.peers,
        replicate_group=links.replicate_group,
        job_group=links.topology.job_group,
        device_mesh=links.topology.mesh,
        **state_options,
    )


def check_devices(model: nn.Module) -> torch.device | None:
    """The one device every parameter lives on, None if all are on meta; raises otherwise."""
    params = list(model.parameters())
    if not params:
        raise ZrsError(
            f"{type(model).__name__} has no parameters: there is nothing for zrs to shard; "
            "pass the model that owns the parameters to zrs.compile"
        )
    if any(getattr(m, "_zrs_params", None) for m in model.modules()):
        raise ZrsError(
            "this model is already sharded by zrs (zrs.compile or zrs.shard): shard a model "
            "once, with one of them, and call the model it returned"
        )
    devices = {p.device for p in params if p.device.type != "meta"}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ZrsError(
            f"parameters are on mixed devices ({names}); zrs shards a model that lives on one "
            "device: move it first with model.to(device), or build it on the meta device"
        )
    return next(iter(devices)) if devices else None


def resolve_device(model: nn.Module, group: dist.ProcessGroup | None) -> torch.device:
    device = check_devices(model)
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())  # NCCL needs this rank's GPU
    return device if device is not None else torch.device("cpu")


class Links:
    """The groups, device and number of one zrs.compile (or zrs.shard) call, and its
    communicators and store meeting, all with one timeout: `timeout` seconds, else the process
    group's own. The meeting and the host-side exchanges span every rank of the job (all
    replicas: two that compiled different graphs would hang in the gradient all-reduce); the
    gathers and reduce-scatters run within the shard group."""

    def __init__(
        self,
        topology: Topology,
        device: torch.device,
        timeout: float | None,
        entry: int,
    ):
        self.topology = topology
        self.group = topology.shard
        self.device = device
        self.entry = entry
        self.gather_group = self.reduce_group = self.group
        self.replicate_group: dist.ProcessGroup | None = None
        self.control_group: dist.ProcessGroup | None = None
        self.peers: Peers | None = None
        job = topology.job_group
        if job is None:
            self.timeout = datetime.timedelta(minutes=30)
            return
        own = group_timeout(job)
        self.timeout = datetime.timedelta(seconds=timeout) if timeout is not None else own
        if dist.get_world_size(job) > 1:
            self.peers = Peers(job, f"{job.group_name}/{entry}", self.timeout)

    def connect(self, separate_reduce_communicator: bool) -> None:
        """Make the communicators: the all-gathers' (the shard group itself when its timeout is
        the one asked for), the reduce-scatters' (`separate_reduce_communicator`), the gradient
        all-reduce's across the replicas, and a gloo group over the job for the host-side
        exchanges."""
        group = self.gather_group
        assert group is not None
        rows = self.topology.family(SHARD_DIM)
        if group_timeout(group) != self.timeout:
            self.gather_group = new_group_like(group, self.timeout, family=rows)
        self.reduce_group = self.gather_group
        if separate_reduce_communicator:
            self.reduce_group = new_group_like(group, self.timeout, family=rows)
        replicate = self.topology.replicate
        if replicate is not None and self.topology.replicas > 1:
            columns = self.topology.family(REPLICATE_DIM)
            self.replicate_group = new_group_like(replicate, self.timeout, family=columns)
        job = self.topology.job_group
        assert job is not None
        self.control_group = new_group_like(job, self.timeout, backend="gloo")


def describe(model: nn.Module, settings: dict[str, Any]) -> list[str]:
    """What every rank must agree on before sharding: each parameter (name, shape, dtype,
    requires_grad, whether on meta) and the options."""
    lines = [f"{k}={v}" for k, v in settings.items()]
    for name, p in model.named_parameters():
        where = "meta" if p.is_meta else "real"
        lines.append(f"{name} {list(p.shape)} {p.dtype} grad={p.requires_grad} {where}")
    return lines
