"""socompile.AdamW's runtime settings (``cpu_worker``, ``rollback``, ``host_master``), checked and resolved: a bad
value is a ValueError naming the choices; "auto" becomes the choice for the runtime and the parameters."""
from __future__ import annotations

import torch

from ..runtime.flat_bucket import real_dtype


def resolve_cpu_worker(cpu_worker: str, runtime_kind: str) -> str:
    """Where the CPU bucket steps run: "thread" (a worker thread beside backward) or "inline" (inside backward)."""
    if cpu_worker not in ("auto", "thread", "inline"):
        raise ValueError(f"cpu_worker must be 'thread' (bucket steps overlap backward on a worker thread), "
                         f"'inline' (run inside the backward, on its thread) or 'auto' (thread when CUDA is "
                         f"available, else inline), got {cpu_worker!r}")
    # NOTE: "inline" exists for CPU-only runs, where the "device" compute and the optimizer share the same
    # cores: a worker thread then only oversubscribes them (torch's OpenMP teams stall at their barriers
    # while a core runs the step), so the step is better taken in between backward nodes. With a GPU,
    # backward runs on the GPU and the worker thread overlaps it for real. Measured on 2 cores (tiny preset,
    # validation on): thread 110-122 ms/step, inline 66-78, no speculation 64-77 (bench/stv.py).
    if cpu_worker == "auto":
        return "thread" if runtime_kind in ("cuda", "emulated") else "inline"
    return cpu_worker


def check_rollback(rollback: str) -> str:
    if rollback not in ("pingpong", "inverse"):
        raise ValueError(f"rollback must be 'pingpong' (exact, 2x optimizer state) or 'inverse' (algebraic, "
                         f"1x state), got {rollback!r}")
    return rollback


def resolve_host_master(host_master: str, param_groups: list[dict], runtime_kind: str) -> str:
    """"shared" (the parameters alias the fp32 host master) or "separate" (a master of its own on the host).
    "auto": shared where every parameter can alias a master of its own dtype (an fp32 or fp64 CPU tensor, not
    under the emulated device, which treats CPU tensors as a GPU's)."""
    if host_master not in ("auto", "shared", "separate"):
        raise ValueError(f"host_master must be 'shared' (fp32 CPU parameters alias the fp32 master), 'separate' "
                         f"(the parameters keep their dtype and device; the fp32 master stays on the host) or "
                         f"'auto' (separate when any parameter is not an fp32 CPU tensor), got {host_master!r}")
    if host_master != "auto":
        return host_master
    return "separate" if any(real_dtype(p.dtype) not in (torch.float32, torch.float64)
                             or p.device.type != "cpu" or runtime_kind == "emulated"
                             for g in param_groups for p in g["params"]) else "shared"
