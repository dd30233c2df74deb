"""The AdamW/Adam step of a device-stepped bucket with torch's fused kernel (``torch._fused_adamw_`` /
``torch._fused_adam_``), run by the bucket's buffers' own device: on CUDA that is the fast path for
GPU-resident buckets; on the CPU the same kernel exists, so the CPU tests check this code's arithmetic.

Same contract as runtime/cpu_adam.step_bucket: step every run of segments with a gradient at ``steps[i] + 1``,
scale gradients by ``grad_scale`` (clipping), return (sum of squared scaled gradients, any non-finite).

Called by runtime/cpu_adam.step_bucket (and ``device_grad_stats`` by its grad_stats) for a bucket whose
buffers are not on the CPU: a device-stepped bucket of a model on a GPU (FlatBucket with a separate host master,
``site="device"``). On the CPU build device-stepped buckets are host memory and take the socompile kernel.
"""
from __future__ import annotations

import torch


def fused_step(bucket, groups: list[dict], grad_scale: float = 1.0) -> tuple[float, bool]:
    total = torch.zeros((), dtype=torch.float64, device=bucket.master.device)
    for start, end, gi, step in bucket.runs(bucket.group_of):
        group = groups[gi]
        p, g, m, v = (t[start:end] for t in (bucket.master, bucket.grad, bucket.exp_avg, bucket.exp_avg_sq))
        if grad_scale != 1.0:
            g = g * grad_scale
        total += g.double().square().sum()
        beta1, beta2 = group["betas"]
        # torch.optim increments the step tensor before calling the fused kernel: pass the new step.
        steps = [torch.tensor(float(step), dtype=torch.float32, device=p.device)]
        kernel = torch._fused_adamw_ if group.get("decoupled", True) else torch._fused_adam_
        kernel([p], [g], [m], [v], [], steps, amsgrad=False, lr=float(group["lr"]), beta1=float(beta1),
               beta2=float(beta2), weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
               maximize=False)
    value = float(total)        # one device->host sync per bucket, as the kernel's own statistics need
    return value, not torch.isfinite(torch.tensor(value)).item()


def device_grad_stats(bucket) -> tuple[float, bool]:
    """(sum of squared gradients in double, any non-finite) over the runs a step would use, on the device."""
    total = torch.zeros((), dtype=torch.float64, device=bucket.grad.device)
    for start, end, _, _ in bucket.runs(bucket.group_of):
        total += bucket.grad[start:end].double().square().sum()
    value = float(total)
    return value, not torch.isfinite(torch.tensor(value)).item()
