"""Process groups for socompile's scale-out: one default group plus a 2-D (dp, sp) mesh.

Launched by ``torchrun`` (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Each rank computes
on one device: with CUDA, cuda:LOCAL_RANK (made current) unless the caller chose one; otherwise the CPU. The
groups are gloo on a CPU and ``cpu:gloo,cuda:nccl`` with CUDA: NCCL for device tensors, gloo for the small host
tensors socompile also reduces (the norm all-reduce, checkpoint metadata), which an NCCL-only group rejects.
Rank r sits at mesh coordinate (r // sp, r % sp): the ranks of one sequence-parallel group are
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
    device: torch.device = torch.device("cpu")   # this rank's compute device (cuda:LOCAL_RANK on a GPU node)

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: dp {self.dp_rank}/{self.dp}, sp {self.sp_rank}/{self.sp}, "
                f"timeout {self.timeout_s:g}s")


def default_backend(device: torch.device | None = None) -> str:
    """gloo on a CPU; with CUDA, NCCL for device tensors and gloo for host tensors in the same groups."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device is None else torch.device(device)
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def select_device(device: torch.device | str | int | None = None) -> torch.device:
    """This rank's compute device, made current for CUDA. ``device`` given: that one. Otherwise, with CUDA: the
    current CUDA device if the caller already set one (``torch.cuda.set_device(k)``, k != 0), else
    cuda:LOCAL_RANK (every rank of a node would use cuda:0 otherwise); without CUDA the CPU.

    ``device="cuda"`` (no index) picks the device as if none were given, on CUDA.

    NOTE: torch cannot tell a device set to 0 by the caller from the default, so a rank with LOCAL_RANK k > 0
    that must use cuda:0 (e.g. one GPU per rank through CUDA_VISIBLE_DEVICES) passes ``device="cuda:0"``."""
    if device is not None:
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type != "cuda":
            return device
        if not torch.cuda.is_available():
            raise RuntimeError(f"socompile.distributed: device={str(device)!r}, but CUDA is not available in this "
                               "process; pass device=None (the CPU here) or run where a GPU is visible.")
        if device.index is not None:
            return _use_cuda_device(device.index, f"device={str(device)!r}")
    elif not torch.cuda.is_available():
        return torch.device("cpu")
    current = torch.cuda.current_device()
    if current != 0:   # chosen by the caller before init_distributed: keep it
        return torch.device("cuda", current)
    return _use_cuda_device(_local_rank(), f"LOCAL_RANK={os.environ.get('LOCAL_RANK', '0')}")


def _local_rank() -> int:
    value = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"socompile.distributed: LOCAL_RANK={value!r} is not an integer; torchrun sets it to "
                         "the rank's index on its node (0 .. nproc-per-node - 1)") from None


def _use_cuda_device(index: int, source: str) -> torch.device:
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise RuntimeError(
            f"socompile.distributed: {source} asks for cuda:{index}, but this process sees {count} CUDA "
            f"device(s). Start at most {count} processes per node (torchrun --nproc-per-node {count}); if each "
            "rank sees only its own GPUs (CUDA_VISIBLE_DEVICES per rank), pass init_distributed(device=\"cuda:0\") "
            "or call torch.cuda.set_device before it.")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(dp: int | None = None, sp: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S,
                     backend: str | None = None, device: torch.device | str | int | None = None) -> Topology:
    """Join the job torchrun started (or reuse an initialised default group) and build the (dp, sp) mesh.

    ``dp=None`` takes every rank not used by ``sp``. ``timeout_s`` bounds every collective on every group made
    here: a dead or hung rank makes the others raise within it instead of waiting forever. ``device``: this
    rank's device (default: ``select_device``, cuda:LOCAL_RANK with CUDA); ``backend``: the default group's
    (default: ``default_backend`` of that device).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    timeout = datetime.timedelta(seconds=timeout_s)
    device = select_device(device)
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"socompile.distributed: {', '.join(missing)} not set. Launch with torchrun, e.g. "
                               "`torchrun --nproc-per-node 2 examples/dist_train.py --dp 2`, or call "
                               "torch.distributed.init_process_group yourself first.")
        dist.init_process_group(backend or default_backend(device), timeout=timeout)
    return make_topology(dp, sp, timeout_s, device)


def make_topology(dp: int | None, sp: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                  device: torch.device | str | int | None = None) -> Topology:
    """Build the groups of a (dp, sp) mesh over the initialised default group. Every rank must call this
    with the same arguments (group creation is itself collective). The groups take the default group's
    backend (``cpu:gloo,cuda:nccl`` stays both); ``device`` as in ``select_device``."""
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
    device = select_device(device)
    mesh = _device_mesh(grid, dp_group, sp_group, device.type)
    return Topology(dp=dp, sp=sp, rank=rank, world_size=world, timeout_s=timeout_s, world_group=world_group,
                    dp_group=dp_group, sp_group=sp_group, mesh=mesh, device=device)


def _device_mesh(grid: torch.Tensor, dp_group, sp_group, device_type: str):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group([dp_group, sp_group], device_type, mesh=grid, mesh_dim_names=("dp", "sp"))


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
