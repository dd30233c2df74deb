"""Custom ops of activation offload (passes/activations.py): saved activations go to host memory in forward and
come back to the device in backward, one layer ahead of their use.

    socompile::offload_activation(handle, layer, t) -> Tensor       (forward, right after t is produced)
        a host tensor of t's size, stride and dtype; the device->host copy is queued on the runtime's
        "activations" stream. The graph saves the host tensor, not t.
    socompile::offload_wait(handle, layer, hosts, keepalive) -> ()   (forward, one offloaded layer later)
        the compute stream waits for ``layer``'s copies. ``hosts`` are the layer's offload outputs (so the
        wait comes after every offload of the layer in any scheduler); ``keepalive`` lists the device tensors
        they copy, so no compiler (Inductor reuses dead buffers for new ones) hands their memory to another
        tensor while a copy still reads it; the graph frees them right after.
    socompile::prefetch_activations(handle, layer, hosts) -> Tensor  (backward, one offloaded layer ahead)
        queue the host->device copies of ``layer``'s saved tensors into fresh device buffers; returns an empty
        "ticket" tensor that the layer's waits take, so every scheduler runs them after it
    socompile::wait_activation(handle, layer, index, host, ticket, device) -> Tensor
        (backward, before the first use) the compute stream waits for copy ``index`` of ``layer``; the device
        tensor has the saved tensor's size and stride, and the graph owns it from here

NOTE: order by data, not by effect. All four register an ORDERED effect (dead-code elimination keeps
``offload_wait``, which returns nothing), but torch 2.13's Inductor orders effectful ops only when they come
wrapped in ``with_effects`` from tracing; ops inserted after partitioning are plain fallback kernels that its
scheduler may reorder (measured: an ``offload_wait`` ran before two of its layer's offloads). So each op that must
come after another takes that one's output as an argument.
"""
from __future__ import annotations

import torch

from ..runtime import handles


@torch.library.custom_op("socompile::offload_activation", mutates_args=())
def offload_activation(handle: int, layer: str, t: torch.Tensor) -> torch.Tensor:
    return handles.lookup(handle).offload(layer, t)


@offload_activation.register_fake
def _(handle, layer, t):
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")


@torch.library.custom_op("socompile::offload_wait", mutates_args=())
def offload_wait(handle: int, layer: str, hosts: list[torch.Tensor], keepalive: list[torch.Tensor]) -> None:
    handles.lookup(handle).wait_offloads(layer)


@offload_wait.register_fake
def _(handle, layer, hosts, keepalive) -> None:
    return None


@torch.library.custom_op("socompile::prefetch_activations", mutates_args=())
def prefetch_activations(handle: int, layer: str, hosts: list[torch.Tensor]) -> torch.Tensor:
    handles.lookup(handle).prefetch(layer, list(hosts))
    return torch.empty(0)


@prefetch_activations.register_fake
def _(handle, layer, hosts):
    return torch.empty(0, device="cpu")


@torch.library.custom_op("socompile::wait_activation", mutates_args=())
def wait_activation(handle: int, layer: str, index: int, host: torch.Tensor, ticket: torch.Tensor,
                    device: torch.device) -> torch.Tensor:
    return handles.lookup(handle).wait(layer, index)


@wait_activation.register_fake
def _(handle, layer, index, host, ticket, device):
    return torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=device)


def _register_ordered_effects() -> None:
    # Private API, as in offload_ops.py (present in torch 2.4 through 2.13).
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    ops = torch.ops.socompile
    for op in (ops.offload_activation.default, ops.offload_wait.default, ops.prefetch_activations.default,
               ops.wait_activation.default):
        _register_effectful_op(op, _EffectType.ORDERED)


_register_ordered_effects()
