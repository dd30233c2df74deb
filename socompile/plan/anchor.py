"""A plan's node-level fields re-anchored onto the IR of the graphs that run.

The planner decides on the stock min-cut partition. When it chose to recompute some layers, the pipeline tags
them in the joint graph and partitions again (socompile/pipeline.py): the backward then holds the recomputed
forward nodes and its node keys shift. ``anchored`` moves each bucket's step point (``ready_after`` and
``ready_position``) onto the new backward; nothing else of the plan changes, and the planner does not run again.

Why the decisions stay valid without planning again:

- The planner's activation policy chose "recompute" / "selective" knowing what it costs: its memory model drops
  the layer's saved tensors and keeps its input (and, selective, its attention outputs), its time model adds
  the layer's forward again to the backward (plan/activation_policy.py). The re-partition applies exactly that
  choice, so the buckets, sites, flow and rollback modes were decided for the memory and time the new graphs
  have. Planning again on the re-partitioned graphs would count the recompute twice: once as nodes already in
  the backward graph, once more in the policy's pinned choice.
- A bucket is a set of parameters; the re-partition renames no parameter and creates no gradient, so every
  bucket still has all its gradients and readers in the new backward, and ``ready_position`` (the planner's own
  function) finds the first point after all of them, as it did on the first partition. The invariant checker
  (plan/verify.py) checks exactly this on the rewritten graphs.
- The weight-flow schedule (where each flow bucket is fetched, waited for, released) is derived from the plan
  and the IR when the runtime is bound, so it follows the new graphs by construction. A recomputed layer reads
  its weights again inside its own backward span, so a bucket that streamed through one interval of uses still
  does.
"""
from __future__ import annotations

import dataclasses

from ..capture.ir import IR
from .plan import Plan
from .planner import ready_position


def anchored(plan: Plan, ir: IR) -> Plan:
    """``plan`` with each bucket's ``ready_after`` / ``ready_position`` recomputed on ``ir`` (pure)."""
    position = {key: i for i, key in enumerate(ir.bw_order)}
    buckets = []
    for bucket in plan.buckets:
        pos = ready_position(ir, list(bucket.params), position)
        buckets.append(dataclasses.replace(bucket, ready_after=ir.bw_order[pos], ready_position=pos))
    return dataclasses.replace(plan, buckets=tuple(buckets))
