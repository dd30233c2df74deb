"""The AdamW/Adam step of a device-stepped bucket with torch's fused kernel (``torch._fused_adamw_`` /
``torch._fused_adam_``), run by the bucket's buffers' own device: on CUDA that is the fast path for
GPU-resident buckets; on the CPU the same kernel exists, so the CPU tests check this code's arithmetic.

Same contract as runtime/cpu_adam.step_bucket: step every run of segments with a gradient at ``steps[i] + 1``,
scale gradients by ``grad_scale`` (clipping), return (sum of squared scaled gradients, any non-finite).

NOTE: not yet called by socompile.AdamW. Device-stepped buckets are host memory on the CPU build (FlatBucket
holds fp32 CPU parameters), where the socompile kernel is the right one; the optimizer's ``_step_now`` needs one
line, ``(fused_step if bucket.master.is_cuda else step_bucket)(...)``, once buckets can live on a GPU.
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
