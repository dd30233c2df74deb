"""What the planner's decisions share: its search state (``_Context``: the IR, profile, options and costs one
``plan()`` call weighs), PlanError and small helpers over it (device memory of a bucket placement, buckets that
can stream). planner.py, floor.py and activation_policy.py import these."""
from __future__ import annotations

import bisect
import dataclasses

import sympy

from ..capture.ir import IR
from ..hardware.profiles import HardwareProfile
from ..options import Options
from ..perf.analysis import GraphCosts
from ..perf.cost import CostModel
from .memory import MemoryEstimate, device_memory
from .step_timeline import step_peak

HOST_HEADROOM = 0.90      # fraction of host memory the plan may use (the OS, the data loader, Python)


class PlanError(ValueError):
    """No plan fits; the message names the minimum memory and what to change."""


@dataclasses.dataclass(frozen=True)   # a candidate changes by dataclasses.replace: no search step edits another's
class _Context:
    ir: IR
    hw: HardwareProfile
    options: Options
    cost: CostModel
    costs: GraphCosts
    weight_bytes: int
    budget: float
    unoptimized_numel: int
    activations: float
    activations_expr: object
    world: int = 1
    dp: int = 1
    sp: int = 1
    choices: tuple = ()            # Plan.activations being planned for
    pinned_choices: tuple | None = None   # per-layer choices given by the caller (plan(..., activations=...))
    offloaded_bytes: float = 0.0   # host bytes of offloaded layers' saved tensors (pinned)
    flow_spans: dict = dataclasses.field(default_factory=dict)   # flow_schedule's per-bucket spans, by params
    weight_dtype: str = "float32"  # the optimized weights' dtype name (dtypes.weights_name): fp16 or bf16 if 2 B


def _device(ctx: _Context, buckets) -> MemoryEstimate:
    """Device memory of a placement; its flow buffers and gradients as the step holds them, node by node."""
    return device_memory(buckets, ctx.weight_bytes, ctx.activations, ctx.activations_expr, ctx.unoptimized_numel,
                         world=ctx.world, step=step_peak(buckets, ctx.ir, ctx.weight_bytes, ctx.flow_spans,
                                                         ctx.world, ctx.costs.partial_gradients),
                         moment_dtype=ctx.options.moment_dtype or "float32")


def _compact_buckets(ctx: _Context, buckets) -> set[int]:
    """Buckets whose uses (forward and backward) contain no other bucket's first use: only these can stream
    through a ring of buffers (a tied embedding read at both ends of the forward would pin its buffer)."""
    ok = {b.index for b in buckets}
    for uses in (ctx.costs.fw_uses, ctx.costs.bw_uses):
        spans = []
        for b in buckets:
            found = [uses[p] for p in b.params if p in uses]
            if found:
                spans.append((min(f[0] for f in found), max(f[1] for f in found), b.index))
        firsts = sorted(s[0] for s in spans)
        for first, last, idx in spans:
            inside = bisect.bisect_right(firsts, last) - bisect.bisect_right(firsts, first)
            if inside:
                ok.discard(idx)
    return ok


def _formula(expr, names: dict[str, str] | None = None) -> str:
    """A bytes expression as text with readable symbol names, e.g. '2147483648 + 262144*batch*seq'."""
    if isinstance(expr, (int, float)):
        return str(int(expr))
    expr = sympy.expand(expr)
    if names:
        expr = expr.xreplace({s: sympy.Symbol(names.get(str(s), str(s))) for s in expr.free_symbols})
    return str(expr)
