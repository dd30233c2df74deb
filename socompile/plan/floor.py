"""The floor of a plan, as the planner states it: the bucket sizes it tries when ``bucket_size`` is not pinned
(gradient staging and weight-flow buffers scale with the bucket, so smaller buckets lower the least device memory
a plan needs), the decision line for a chosen size, and the PlanError message when no size fits."""
from __future__ import annotations

from ..units import human_bytes
from .bucketize import FP32_BYTES
from .memory import MemoryEstimate
from .search_state import _formula, _Context

DEFAULT_BUCKET_BYTES = 64 * 10**6   # options.bucket_size when not pinned and it fits (the presets' plans)
SMALLEST_BUCKET_BYTES = 64 * 10**3  # below this, per-bucket overheads dominate and the floor hardly falls


def bucket_size_candidates(ctx: _Context, order: list[str]) -> list[int]:
    """options.bucket_size when pinned; else 64 MB, then halved while the largest bucket can still shrink
    (not below the largest parameter's fp32 gradient, nor SMALLEST_BUCKET_BYTES)."""
    if ctx.options.bucket_size is not None:
        return [ctx.options.bucket_size]
    largest = max((ctx.ir.params[n].numel * FP32_BYTES for n in order), default=0)
    sizes = [DEFAULT_BUCKET_BYTES]
    while sizes[-1] > max(largest, SMALLEST_BUCKET_BYTES):
        sizes.append(max(sizes[-1] // 2, SMALLEST_BUCKET_BYTES))
    return sizes


def bucket_size_line(ctx: _Context, size: int, peak: float, too_big: int) -> str:
    return (f"bucket size: {human_bytes(size)} (chosen: with {human_bytes(too_big)} buckets the least device memory "
            f"any plan needs is {human_bytes(peak)}, over the budget of {human_bytes(ctx.budget)}: the gradients and "
            f"weight-flow buffers live at once scale with the bucket)")


def bucket_text(ctx: _Context, base, chosen: bool) -> str:
    """The bucket size behind a floor, and whether a smaller one could lower it (a parameter is never split)."""
    size = human_bytes(ctx.options.bucket_size)
    if chosen:
        return f"buckets of {size}, the smallest tried (a parameter is never split: the largest one bounds them)"
    largest = max(base, key=lambda b: b.numel, default=None)
    if largest is not None and len(largest.params) > 1:
        return f"bucket_size={size} (a smaller bucket_size, or none, lowers the gradient staging and flow buffers)"
    return f"bucket_size={size} (its largest bucket is one parameter: smaller buckets would hardly lower the floor)"


def _names(bucket) -> str:
    return ", ".join(repr(p) for p in bucket.params[:3]) + (", ..." if len(bucket.params) > 3 else "")


def peak_text(ctx: _Context, minimum: MemoryEstimate, base) -> str:
    """Where the flow buffers and gradients peak and what they hold there; when one parameter's own fetched
    weights and gradient exceed the budget there, that parameter, named: no bucket size or placement helps."""
    step = minimum.step
    if step is None or not step.total:
        return ""
    by_index = {b.index: b for b in base}
    held = [f"bucket {i} ({_names(by_index[i])}) fetched {human_bytes(v)}" for i, v in step.fetched] + \
           [f"bucket {i} ({_names(by_index[i])}) gradients {human_bytes(v)}" for i, v in step.gradients]
    text = (f". The flow buffers and gradients peak in the {step.phase} at node {step.node.split(':', 1)[1]}, "
            f"holding {'; '.join(held)}")
    fetched, grads = dict(step.fetched), dict(step.gradients)
    alone = max(((fetched.get(i, 0) + grads.get(i, 0), i) for i in {*fetched, *grads}
                 if len(by_index[i].params) == 1), default=(0, None))
    if alone[0] > ctx.budget:
        name = by_index[alone[1]].params[0]
        text += (f": parameter {name!r} alone needs {human_bytes(alone[0], round_up=True)} there (its weights "
                 f"and its gradient at once), over the budget of {human_bytes(ctx.budget)}; a parameter is never "
                 f"split, so no bucket size or placement lowers that")
    return text


def infeasible_message(ctx: _Context, minimum: MemoryEstimate, recompute: str, buckets: str, base=()) -> str:
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in minimum.device_parts if v)
    need = human_bytes(minimum.device_peak, round_up=True)
    expr = ctx.activations_expr
    formula = "" if isinstance(expr, (int, float)) else \
        f"; activations = {_formula(expr, ctx.ir.symbol_names)} bytes"
    room = (f"raise device_memory_budget to at least {need}" if ctx.options.device_memory_budget is not None else
            f"choose a target with at least {human_bytes(minimum.device_peak + ctx.hw.device_reserved, True)} of "
            f"device memory")
    return (f"no plan fits in {human_bytes(ctx.budget)} of device memory on {ctx.hw.name}: even with every "
            f"optimizer bucket on the CPU, every weight that can stream streamed and "
            f"{'per-layer activation checkpointing' if recompute != 'none' else 'no checkpointing possible'}, "
            f"with {buckets}, the step needs at least {need} ({parts}){formula}{peak_text(ctx, minimum, base)}. "
            f"Reduce the "
            f"sequence length or batch, or {room}.")
