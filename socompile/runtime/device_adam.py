"""The AdamW/Adam step of a bucket with torch's fused kernel (``torch._fused_adamw_`` / ``torch._fused_adam_``),
run by the bucket's buffers' own device: on CUDA that is the fast path for GPU-resident (device-stepped)
buckets; on the CPU it steps float64 buckets (float64 parameters keep float64 state, which the socompile kernel,
fp32 only, cannot step), and the CPU tests check this code's arithmetic with it.

Same contract as runtime/cpu_adam.step_bucket: step every run of segments with a gradient at ``steps[i] + 1``,
scale gradients by ``grad_scale`` (clipping), return (sum of squared scaled gradients, any non-finite);
``outputs`` (the ping-pong spare) receive the step while the current state stays as it was. ``inverse_step``
is the algebraic inverse of an in-place step (rollback="inverse").

Called by runtime/cpu_adam.step_bucket (``device_grad_stats`` by its grad_stats, ``inverse_step`` by its
rollback_inplace) for a bucket whose buffers are not fp32 host memory: a device-stepped bucket of a model on a
GPU (FlatBucket with a separate host master, ``site="device"``), or a float64 bucket.
"""
from __future__ import annotations

import math

import torch

from .int8_moments import as_fp32, encode_moments, round_bits, round_seed, stochastic_bf16
from .traffic import DEVICE_READ


class DeviceStats:
    """(sum of squared scaled gradients, any non-finite) of a device step, read on the host only when asked
    (``stats[0]``, ``stats[1]``, unpacking). The step itself queues kernels only: reading a device value blocks
    the host until the device is there, and a step nobody validates (no clipping, no skip-on-overflow) never
    asks, so it never blocks. The statistics take their own pass over the gradients (float64, as torch's norm
    of fp32 gradients is accumulated wider), done at the first read, on the gradients the step used: the
    landing buffer is not rewritten before ``step()`` has read them."""

    def __init__(self, grads: list[torch.Tensor], grad_scale: float, blocks=None):
        self._grads, self._scale, self._value = grads, grad_scale, None
        self._blocks = blocks   # runtime/traffic.py HostBlockLedger: the read is a wait on the device

    def _read(self) -> tuple[float, bool]:
        if self._value is None:
            total = None
            for g in self._grads:
                scaled = g * self._scale if self._scale != 1.0 else g   # in the gradients' dtype, as the step's
                part = scaled.double().square().sum()
                total = part if total is None else total + part
            value = 0.0 if total is None else self._to_host(total)   # the one device->host read
            self._value, self._grads = (value, not math.isfinite(value)), None
        return self._value

    def _to_host(self, total: torch.Tensor) -> float:
        if self._blocks is None:   # host memory (a float64 bucket on the CPU): nothing to wait for
            return float(total)
        return self._blocks.wait(DEVICE_READ, "device-stepped bucket's gradient norm", False, lambda: float(total))

    def __getitem__(self, i: int):
        return self._read()[i]

    def __iter__(self):
        return iter(self._read())

    def __len__(self) -> int:
        return 2


def _device_blocks(bucket):
    """Where a device value read of ``bucket`` is booked: its host-block ledger when its state is device memory
    of a CUDA runtime (or the emulated one); None for host memory (a float64 bucket on the CPU build)."""
    device_state = bucket.site == "device" and bucket.separate_device
    return bucket.host_blocks if device_state else None


def fused_step(bucket, groups: list[dict], grad_scale: float = 1.0, outputs=None) -> DeviceStats:
    """bf16 or int8 moments (``bucket.moments_rounded``): each run's moments are decoded into fp32 temporaries,
    stepped, and rounded back stochastically with the bits the CPU kernel draws for the same elements and step
    (socompile/runtime/int8_moments.py, torch ops on the buffers' device)."""
    used = []
    for start, end, gi, step in bucket.runs(bucket.group_of):
        group = groups[gi]
        p, stored_m, stored_v = _state_slices(bucket, start, end, outputs)
        m, v = as_fp32(bucket.moment_format, stored_m, stored_v, end - start)
        used.append(bucket.grad[start:end])
        g = used[-1] * grad_scale if grad_scale != 1.0 else used[-1]
        beta1, beta2 = group["betas"]
        # torch.optim increments the step tensor before calling the fused kernel: pass the new step. A fill on
        # the device (not torch.tensor(...), a copy from host memory) so that nothing waits for the device.
        steps = [torch.full((), float(step), dtype=torch.float32, device=p.device)]
        kernel = torch._fused_adamw_ if group.get("decoupled", True) else torch._fused_adam_
        kernel([p], [g], [m], [v], [], steps, amsgrad=False, lr=float(group["lr"]), beta1=float(beta1),
               beta2=float(beta2), weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
               maximize=False)
        if bucket.moments_rounded:
            _store_rounded(bucket.moment_format, stored_m, stored_v, m, v, round_seed(bucket.index, step, start))
    return DeviceStats(used, grad_scale, _device_blocks(bucket))


def _store_rounded(moment_format: str, stored_m: torch.Tensor, stored_v: torch.Tensor, m: torch.Tensor,
                   v: torch.Tensor, seed: int) -> None:
    """Round a run's stepped fp32 moments into its bf16 or int8 buffers, as the CPU kernel rounds (exp_avg the
    low 16 bits of each element's hash, exp_avg_sq the high 16)."""
    if moment_format == "int8":
        codes_m, codes_v = encode_moments(m, v, seed)
        stored_m.copy_(codes_m)
        stored_v.copy_(codes_v)
        return
    bits = round_bits(seed, 0, m.numel(), m.device)
    stored_m.copy_(stochastic_bf16(m, bits))
    stored_v.copy_(stochastic_bf16(v, bits >> 16))


def _state_slices(bucket, start: int, end: int, outputs):
    """(weights, exp_avg, exp_avg_sq) of bucket elements [start, end) that the step updates in place: the
    bucket's own, or with ``outputs`` (the spare) the spare's, first filled with the current values."""
    loc = bucket.local(start, end)
    current = (bucket.master[start:end], bucket.moment_range(bucket.exp_avg, loc),
               bucket.moment_range(bucket.exp_avg_sq, loc))
    if outputs is None:
        return current
    # indexed like the state (a sharded spare: its window)
    spare = (outputs[0][loc], bucket.moment_range(outputs[1], loc), bucket.moment_range(outputs[2], loc))
    for dst, src in zip(spare, current):
        dst.copy_(src)
    return spare


def inverse_step(bucket, groups: list[dict], grad_scale: float) -> None:
    """Undo an in-place ``fused_step`` with the same gradients: the step's algebra solved for the previous
    (weights, exp_avg, exp_avg_sq), in float64 (the roundings of the step are not undone). The same algebra as
    the socompile kernel's ``adam_rollback``. Refused before anything changes when a group's step cannot be
    inverted."""
    runs = bucket.runs(bucket.group_of)
    for _, _, gi, _ in runs:
        _check_invertible(groups[gi])
    for start, end, gi, step in runs:
        group = groups[gi]
        p, m, v = _state_slices(bucket, start, end, None)
        g = bucket.grad[start:end].double() * grad_scale
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        beta1, beta2 = (float(b) for b in group["betas"])
        decoupled = group.get("decoupled", True)
        p1, m1, v1 = p.double(), m.double(), v.double()
        denom = v1.sqrt() / math.sqrt(1.0 - beta2 ** step) + eps
        p0 = (p1 + lr / (1.0 - beta1 ** step) * m1 / denom) / (1.0 - lr * wd if decoupled else 1.0)
        if not decoupled and wd != 0.0:
            g = g + wd * p0
        m.copy_((m1 - (1.0 - beta1) * g) / beta1)
        v.copy_(((v1 - (1.0 - beta2) * g * g) / beta2).clamp_(min=0.0))
        p.copy_(p0)


def _check_invertible(group: dict) -> None:
    beta1, beta2 = (float(b) for b in group["betas"])
    decay = 1.0 - float(group["lr"]) * float(group["weight_decay"]) if group.get("decoupled", True) else 1.0
    if beta1 == 0.0 or beta2 == 0.0 or decay == 0.0:
        raise RuntimeError("rollback='inverse' cannot undo a step with beta1 or beta2 == 0 or lr * weight_decay "
                           "== 1 (the step forgets the previous values); use rollback='pingpong'")


def device_grad_stats(bucket) -> DeviceStats:
    """(sum of squared gradients in double, any non-finite) over the runs a step would use, on the device,
    read on the host when asked (``DeviceStats``)."""
    return DeviceStats([bucket.grad[start:end] for start, end, _, _ in bucket.runs(bucket.group_of)], 1.0,
                       _device_blocks(bucket))
