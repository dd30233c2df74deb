"""The planner: ``plan(ir, hw, options) -> Plan``. Pure and deterministic.

This first planner buckets gradients in backward order and steps every bucket on the CPU; the cost model
(issue 4) will choose GPU-resident buckets, weight flow, cast sites and prefetch distances.
"""
from __future__ import annotations

from ..capture.ir import IR
from ..options import Options
from .bucketize import FP32_BYTES, bucketize
from .hardware import HardwareProfile
from .plan import BucketPlan, Plan


def ready_position(ir: IR, params: list[str]) -> int:
    """Index in backward order after which every gradient of ``params`` exists and no backward node
    reads any of them (or a saved view of them): from there on the weights may be updated in place."""
    position = {key: i for i, key in enumerate(ir.bw_order)}
    last = max(position[ir.grad_node[p]] for p in params)
    for p in params:
        for reader in ir.bw_readers.get(p, ()):
            last = max(last, position[reader])
    return last


def plan(ir: IR, hw: HardwareProfile, options: Options) -> Plan:
    order = [name for name in ir.grad_order() if ir.params[name].optimized]
    groups = bucketize([(n, ir.params[n].numel) for n in order], options.bucket_size)
    buckets = []
    for index, names in enumerate(groups):
        pos = ready_position(ir, names)
        numel = sum(ir.params[n].numel for n in names)
        buckets.append(BucketPlan(index=index, params=tuple(names), numel=numel, grad_bytes=numel * FP32_BYTES,
                                  optimizer_site="cpu", ready_after=ir.bw_order[pos], ready_position=pos))
    unoptimized = tuple(n for n in ir.grad_order() if not ir.params[n].optimized)
    return Plan(target=hw.name, bucket_size=options.bucket_size, buckets=tuple(buckets),
                unoptimized_params=unoptimized)
