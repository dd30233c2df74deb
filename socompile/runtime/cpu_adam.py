"""Steps one FlatBucket with the socompile_ext CPU kernel (one kernel call per run of segments)."""
from __future__ import annotations

from .flat_bucket import FlatBucket


def _kernel():
    try:
        import socompile_ext
    except ImportError as exc:  # the extension is built by `pip install -e .` / `make test`
        raise ImportError("socompile_ext (the CPU Adam kernel) is not built: run `make test` or "
                          "`pip install --no-build-isolation -e .` in the socompile checkout") from exc
    return socompile_ext


def step_bucket(bucket: FlatBucket, groups: list[dict], group_of: list[int], grad_scale: float = 1.0) -> None:
    """AdamW/Adam step of every segment of ``bucket`` that has a gradient, then bump their step counts."""
    kernel = _kernel()
    for start, end, gi, step in bucket.runs(group_of):
        group = groups[gi]
        beta1, beta2 = group["betas"]
        kernel.adam_step(bucket.master[start:end], bucket.grad[start:end], bucket.exp_avg[start:end],
                         bucket.exp_avg_sq[start:end], step=step, lr=float(group["lr"]), beta1=float(beta1),
                         beta2=float(beta2), eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                         decoupled=group.get("decoupled", True), grad_scale=grad_scale)
    for i, present in enumerate(bucket.has_grad):
        if present:
            bucket.steps[i] += 1
    bucket.stepped = True


def grad_sumsq(bucket: FlatBucket) -> tuple[float, bool]:
    """Sum of squared gradients over segments that have one, and whether any is non-finite."""
    kernel = _kernel()
    total, nonfinite = 0.0, False
    for i, present in enumerate(bucket.has_grad):
        if present:
            s, bad = kernel.grad_stats(bucket.grad[bucket.segment(i)])
            total += s
            nonfinite |= bad
    return total, nonfinite
