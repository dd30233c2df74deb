"""Compile hook ``check_plan_across_ranks``: once the plan is made, compare this rank's plan with every other
rank's (listed in socompile/passes/table.py, HOOKS; it leaves the graphs unchanged)::

    all_gather(int64 hash of (plan JSON fields, options, parameter names))   # once per compiled graph pair
    differ -> all_gather_object(per-field hashes and values)                # fixed size first: cannot abort
           -> PlanMismatchError naming the fields (e.g. options.bucket_size, plan.buckets[3])

It runs when torch.distributed is initialised with more than one rank, with or without a socompile optimizer,
and can be turned off by name (``disable_passes=["check_plan_across_ranks"]``).
"""
from __future__ import annotations

from . import faults


def check_plan_across_ranks(ctx) -> None:
    params = sorted(ctx.param_names.values())
    faults.check_plan_across_ranks(ctx.plan, ctx.options, extra={"model.parameters": params})
