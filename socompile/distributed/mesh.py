"""Process groups for socompile's scale-out: one default group plus a 2-D (dp, sp) mesh.

Launched by ``torchrun`` (which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), gloo on the CPU and NCCL on a
GPU. Rank r sits at mesh coordinate (r // sp, r % sp): the ranks of one sequence-parallel group are
consecutive, so on a GPU node they share the fastest links (Ulysses does an all-to-all in every layer; the
data-parallel reduce-scatter runs once per bucket).

NOTE: timeouts. ``init_process_group(timeout=...)`` only sets the default group's timeout; sub-groups made by
``new_group(timeout=None)``, as ``init_device_mesh`` makes them, fall back to torch's 30-minute default. A dead
or hung peer would then stall the sequence-parallel all-to-all for half an hour. So the groups are made here
with the caller's timeout and the DeviceMesh is assembled from them with ``DeviceMesh.from_group``.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0   # seconds a collective may wait for a peer before every rank fails with an error


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits: its ranks, the parallel degrees and the groups to talk over."""

    dp: int                      # data-parallel degree (ZeRO shards the optimizer over dp * sp ranks)
    sp: int                      # sequence-parallel degree (Ulysses all-to-all inside attention)
    rank: int
    world_size: int
    timeout_s: float
    world_group: Any             # all ranks: gradient reduction (dp and sp shards see different tokens)
    dp_group: Any                # ranks holding the same sequence shard of different batches
    sp_group: Any                # ranks holding the shards of one sequence
    mesh: Any = None             # torch DeviceMesh with dims ("dp", "sp"), for DTensor users

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: dp {self.dp_rank}/{self.dp}, sp {self.sp_rank}/{self.sp}, "
                f"timeout {self.timeout_s:g}s")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(dp: int | None = None, sp: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S,
                     backend: str | None = None) -> Topology:
    """Join the job torchrun started (or reuse an initialised default group) and build the (dp, sp) mesh.

    ``dp=None`` takes every rank not used by ``sp``. ``timeout_s`` bounds every collective on every group made
    here: a dead or hung rank makes the others raise within it instead of waiting forever.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"socompile.distributed: {', '.join(missing)} not set. Launch with torchrun, e.g. "
                               "`torchrun --nproc-per-node 2 examples/dist_train.py --dp 2`, or call "
                               "torch.distributed.init_process_group yourself first.")
        dist.init_process_group(backend or default_backend(), timeout=timeout)
    return make_topology(dp, sp, timeout_s)


def make_topology(dp: int | None, sp: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> Topology:
    """Build the groups of a (dp, sp) mesh over the initialised default group. Every rank must call this
    with the same arguments (group creation is itself collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if sp < 1 or world % sp:
        raise ValueError(f"sp={sp} must be a positive divisor of the world size {world}")
    dp = world // sp if dp is None else dp
    if dp * sp != world:
        raise ValueError(f"dp * sp = {dp} * {sp} = {dp * sp}, but {world} processes were launched; "
                         f"launch dp * sp processes (torchrun --nproc-per-node {dp * sp})")
    timeout = datetime.timedelta(seconds=timeout_s)
    grid = torch.arange(world).view(dp, sp)
    # Every rank creates every group, in the same order: new_group is collective over the default group.
    sp_groups = [dist.new_group(grid[i].tolist(), timeout=timeout) for i in range(dp)]
    dp_groups = [dist.new_group(grid[:, j].tolist(), timeout=timeout) for j in range(sp)]
    world_group = dist.new_group(list(range(world)), timeout=timeout)
    sp_group, dp_group = sp_groups[rank // sp], dp_groups[rank % sp]
    mesh = _device_mesh(grid, dp_group, sp_group)
    return Topology(dp=dp, sp=sp, rank=rank, world_size=world, timeout_s=timeout_s, world_group=world_group,
                    dp_group=dp_group, sp_group=sp_group, mesh=mesh)


def _device_mesh(grid: torch.Tensor, dp_group, sp_group):
    from torch.distributed.device_mesh import DeviceMesh

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return DeviceMesh.from_group([dp_group, sp_group], device, mesh=grid, mesh_dim_names=("dp", "sp"))


@torch.no_grad()
def average_gradients(params, group) -> None:
    """All-reduce ``.grad`` of every parameter and divide by the group size (plain data parallelism, for
    parameters no socompile optimizer shards). Gradients are flattened into one buffer: one collective."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    from .faults import guard

    flat = torch.cat([g.reshape(-1) for g in grads])
    with guard("average_gradients (all_reduce)", group):
        dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)   # gloo has no AVG/PREMUL_SUM: sum, then divide
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
