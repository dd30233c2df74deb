"""Pass ``check_plan_across_ranks``: at compile time, compare this rank's plan with every other rank's.

Pattern inserted: none; the graph is returned unchanged::

    all_gather(int64 hash of (plan JSON fields, options, parameter names))   # once, when backward is compiled
    differ -> all_gather_object(per-field hashes and values)                # fixed size first: cannot abort
           -> PlanMismatchError naming the fields (e.g. options.bucket_size, plan.buckets[3])

It runs only when torch.distributed is initialised with more than one rank. Registered by
``init_distributed``/``make_topology``/``shard_optimizer`` (not by importing the package), so it can be
disabled by name (``disable_passes=["check_plan_across_ranks"]``) only after one of those calls.
"""
from __future__ import annotations

import torch.distributed as dist

from ..passes.registry import register
from .faults import check_plan_across_ranks

PASS_NAME = "check_plan_across_ranks"


@register(PASS_NAME, phase="bw")
def check_plan_pass(gm, plan, ctx):
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        params = sorted(ctx.param_names.values())
        check_plan_across_ranks(plan, ctx.options, extra={"model.parameters": params})
    return gm
