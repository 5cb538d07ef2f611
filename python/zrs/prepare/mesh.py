"""Which ranks a model shards over and which hold replicas of it: `process_group=` (one flat
shard group, as always) or `mesh=`, a DeviceMesh of one dimension (the same) or two, a replicate
and a shard dimension (hybrid sharding, docs/hybrid.md), resolved into the groups the rest of
zrs uses."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from zrs._core import ZrsError

# torchtitan's names for the two dimensions; an unnamed 2-D mesh reads (replicate, shard), as
# FSDP2's fully_shard reads one.
REPLICATE_DIM, SHARD_DIM = "dp_replicate", "dp_shard"


@dataclass(frozen=True)
class Topology:
    """The groups of one model. `shard`: what the parameters are sharded over (None: one process
    without torch.distributed). `replicate`: the ranks holding the same shard in the other
    replicas (None: one replica). `job`: every rank of both, which meets to agree and checkpoints
    together. `mesh`: the 2-D mesh the parameters' DTensors live on (None: one made over
    `shard`)."""

    shard: dist.ProcessGroup | None
    replicate: dist.ProcessGroup | None = None
    job: dist.ProcessGroup | None = None
    mesh: DeviceMesh | None = None

    @property
    def replicas(self) -> int:
        return dist.get_world_size(self.replicate) if self.replicate is not None else 1

    def family(self, dim: str) -> list[list[int]] | None:
        """The ranks of every group of the mesh's dimension `dim` (SHARD_DIM or REPLICATE_DIM),
        which every rank makes communicators like; None without a 2-D mesh."""
        if self.mesh is None:
            return None
        grid = self.mesh.mesh
        return (grid if dim == SHARD_DIM else grid.T).tolist()

    @property
    def size(self) -> int:
        """Ranks that share the parameters (each holds one shard): the shard group's size."""
        return world_size(self.shard)

    @property
    def job_group(self) -> dist.ProcessGroup | None:
        return self.job if self.job is not None else self.shard

    def describe(self) -> str:
        """What the ranks must agree on: the number of replicas and of shards."""
        return f"{self.replicas}x{self.size}"


def resolve_topology(process_group: dist.ProcessGroup | None, mesh: DeviceMesh | None) -> Topology:
    """The groups of `process_group` or `mesh` (at most one of them given)."""
    if mesh is None:
        return Topology(resolve_group(process_group))
    if process_group is not None:
        raise ZrsError(
            "pass mesh= or process_group=, not both: a 1-D mesh is its group, a 2-D mesh "
            f"holds both of its groups ({REPLICATE_DIM}, {SHARD_DIM})"
        )
    if not isinstance(mesh, DeviceMesh):
        raise ZrsError(f"mesh= takes a torch.distributed DeviceMesh, not {type(mesh).__name__}")
    if mesh.ndim == 1:
        return Topology(mesh.get_group())
    if mesh.ndim != 2:
        raise ZrsError(
            f"mesh= has {mesh.ndim} dimensions; zrs takes a 1-D mesh (sharding) or a 2-D one "
            f"({REPLICATE_DIM}, {SHARD_DIM}): slice the data-parallel dimensions out first, "
            f"e.g. mesh[('{REPLICATE_DIM}', '{SHARD_DIM}')]"
        )
    replicate_dim, shard_dim = _dims(mesh)
    if (replicate_dim, shard_dim) != (0, 1):
        # Its DTensors' placements follow the mesh's order: (Replicate(), Shard(0)).
        raise ZrsError(
            f"mesh= names {SHARD_DIM!r} first: pass it as mesh[('{REPLICATE_DIM}', "
            f"'{SHARD_DIM}')], the replicate dimension first"
        )
    ranks = sorted(mesh.mesh.flatten().tolist())
    job = dist.group.WORLD if ranks == list(range(dist.get_world_size())) else None
    if job is None:
        job = dist.new_group(ranks, use_local_synchronization=True)
    return Topology(mesh.get_group(shard_dim), mesh.get_group(replicate_dim), job, mesh)


def _dims(mesh: DeviceMesh) -> tuple[int, int]:
    """(replicate, shard) dimension indices of a 2-D mesh."""
    names = mesh.mesh_dim_names
    if names is None:
        return 0, 1
    if set(names) != {REPLICATE_DIM, SHARD_DIM}:
        raise ZrsError(
            f"mesh= has dimensions {names}; zrs reads a 2-D mesh by the names "
            f"({REPLICATE_DIM!r}, {SHARD_DIM!r}), or unnamed as (replicate, shard)"
        )
    return names.index(REPLICATE_DIM), names.index(SHARD_DIM)


def resolve_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ZrsError(
            f"zrs.compile (or zrs.shard) was called before torch.distributed.init_process_group, but "
            f"WORLD_SIZE={world}: call dist.init_process_group('nccl' on GPUs, 'gloo' on CPU) "
            "first, or pass process_group="
        )
    return None  # one process, no torch.distributed: collectives are local copies


def world_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1
