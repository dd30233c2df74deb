"""Kernel calls on one FlatBucket: step (in place or into the ping-pong spare), gradient statistics, and the
algebraic inverse. One kernel call per run of segments (see FlatBucket.runs).

NOTE: the bucket's gradient statistics are summed run by run in bucket order, the same way whether they come
from a step (which computes them in the same pass) or from ``grad_stats``, so a speculative and a
non-speculative step see bitwise the same global norm.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from ..plan.host_work import ADAM_KERNEL, INVERSE_STEP, NORM_PASS, adam_kernel_bytes, norm_pass_bytes
from . import ranges
from .flat_bucket import FlatBucket
from .int8_moments import round_seed

# The kernel's thread count is one process-wide setting (socompile_ext.KernelSettings). A bucket whose compiled
# model pinned it (option optimizer_threads) sets it for its own kernel calls only; every kernel call holds this
# lock, so no call (another model's, on another thread) runs with a count that is not its own. The lock guards
# the C library's settings, which exist once per process, so it exists once per process too.
_KERNEL_THREADS_LOCK = threading.Lock()


def _kernel():
    try:
        import socompile_ext
    except ImportError as exc:  # the extension is built by `pip install -e .` / `make test`
        raise ImportError("socompile_ext (the CPU Adam kernel) is not built: run `make test` or "
                          "`pip install --no-build-isolation -e .` in the socompile checkout") from exc
    return socompile_ext


@contextlib.contextmanager
def _kernel_threads(kernel, bucket: FlatBucket):
    """Run the kernel calls inside with ``bucket.kernel_threads`` OpenMP threads (None: the process's count),
    then restore the count the kernel had."""
    with _KERNEL_THREADS_LOCK:
        if bucket.kernel_threads is None:
            yield
            return
        with kernel.kernel_settings(threads=bucket.kernel_threads):
            yield


def _torch_ops(bucket: FlatBucket) -> bool:
    """The socompile kernel steps fp32 host buffers; a device-stepped bucket (buffers on a GPU) and a float64
    one (float64 parameters keep float64 state) are stepped with torch's own ops (runtime/device_adam.py)."""
    return bucket.master.device.type != "cpu" or bucket.master.dtype != torch.float32


def _hyper(group: dict, step: int) -> dict:
    beta1, beta2 = group["betas"]
    return dict(step=step, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), decoupled=group.get("decoupled", True))


@ranges.ranged(ranges.BUCKET_STEP, ranges.own_bucket)
def step_bucket(bucket: FlatBucket, groups: list[dict], grad_scale: float = 1.0,
                into_spare: bool = False) -> tuple[float, bool]:
    """AdamW/Adam step of every segment of ``bucket`` that has a gradient, at step count ``steps[i] + 1``.
    ``into_spare``: read the current state, write the ping-pong spare (current state untouched).
    A bucket with bf16 device weights (separate host master) gets their bf16 copy written by the kernel in
    the same pass, in place or into the spare (``FlatBucket.low_out``): a commit then has no cast left to do,
    and a step that is undone leaves the copy marked as the other master's (cast again at upload).
    A bucket whose buffers are on a GPU (device-stepped), or float64, is stepped by torch's fused kernel.
    Returns the statistics of the scaled gradients. Step counts are bumped by the caller at commit."""
    if _torch_ops(bucket):
        from .device_adam import fused_step
        bucket.before_host_write()
        outputs = bucket.spare_buffers() if into_spare else None
        bucket.kernel_stepped(into_spare, wrote_low=False)
        return fused_step(bucket, groups, grad_scale, outputs=outputs)
    kernel = _kernel()
    bucket.before_host_write()
    outputs = bucket.spare_buffers() if into_spare else None
    low = bucket.low_out(into_spare)
    total, nonfinite = 0.0, False
    with _kernel_threads(kernel, bucket):
        for start, end, gi, step in bucket.runs(bucket.group_of):
            loc = bucket.local(start, end)   # the state buffers (and the spare) may cover this rank's shard only
            own = bucket.host(start, end)    # master and grad too, under device-side ZeRO
            out = {}
            if outputs is not None:
                out = dict(param_out=outputs[0][loc], exp_avg_out=bucket.moment_range(outputs[1], loc),
                           exp_avg_sq_out=bucket.moment_range(outputs[2], loc))
            if low is not None:
                out["param_bf16_out"] = low[start:end]
            if bucket.moments_rounded:
                out["round_seed"] = round_seed(bucket.index, step, start)
            s, bad = kernel.adam_step(bucket.master[own], bucket.grad[own], bucket.moment_range(bucket.exp_avg, loc),
                                      bucket.moment_range(bucket.exp_avg_sq, loc), grad_scale=grad_scale,
                                      **_hyper(groups[gi], step), **out)
            total, nonfinite = total + s, nonfinite or bad
            bucket.host_work.add_work(ADAM_KERNEL, adam_kernel_bytes(end - start, bucket.grad.element_size(),
                                                                     low is not None,
                                                                     moment_bytes=bucket.moment_bytes))
    bucket.kernel_stepped(into_spare, wrote_low=low is not None)
    return total, nonfinite


def grad_stats(bucket: FlatBucket) -> tuple[float, bool]:
    """Sum of squared gradients (unscaled) and any-non-finite over the same runs a step would use."""
    if _torch_ops(bucket):
        from .device_adam import device_grad_stats
        return device_grad_stats(bucket)
    kernel = _kernel()
    total, nonfinite = 0.0, False
    with _kernel_threads(kernel, bucket):
        for start, end, _, _ in bucket.runs(bucket.group_of):
            s, bad = kernel.grad_stats(bucket.grad[bucket.host(start, end)])
            total, nonfinite = total + s, nonfinite or bad
            bucket.host_work.add_work(NORM_PASS, norm_pass_bytes(end - start, bucket.grad.element_size()))
    return total, nonfinite


def rollback_inplace(bucket: FlatBucket, groups: list[dict], grad_scale: float) -> None:
    """Undo an in-place step with the algebraic inverse (memory-tight mode; not bitwise)."""
    bucket.before_host_write()
    bucket.master_changed()
    if _torch_ops(bucket):
        from .device_adam import inverse_step
        inverse_step(bucket, groups, grad_scale)
        return
    kernel = _kernel()
    with _kernel_threads(kernel, bucket):
        for start, end, gi, step in bucket.runs(bucket.group_of):
            loc, own = bucket.local(start, end), bucket.host(start, end)
            kernel.adam_rollback(bucket.master[own], bucket.grad[own], bucket.exp_avg[loc],
                                 bucket.exp_avg_sq[loc], grad_scale=grad_scale, **_hyper(groups[gi], step))
            bucket.host_work.add_work(INVERSE_STEP, adam_kernel_bytes(end - start, bucket.grad.element_size(), False))
