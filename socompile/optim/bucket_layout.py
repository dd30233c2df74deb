"""How socompile.AdamW lays its parameters out in flat buckets (runtime/flat_bucket.py): the pool of parameters
no compiled graph claims, bucketed by size, and the buckets of a layout (the pool's, or a claim's from the plan).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..plan.bucketize import bucketize
from ..runtime.flat_bucket import FlatBucket, real_dtype

if TYPE_CHECKING:
    from .adamw import AdamW


def by_storage(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` split by what one flat bucket can hold together (one real dtype, one device), in order of
    first appearance; a model of one dtype is one list."""
    kinds: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        kinds.setdefault((real_dtype(p.dtype), p.device), []).append(p)
    return list(kinds.values())


def pool_buckets(opt: "AdamW") -> list[FlatBucket]:
    """Bucket every parameter no active claim holds, in reverse registration order (the usual order of
    gradients in backward): trainable ones, and frozen ones that were bucketed before (their state is
    kept, and their weights stay in place when the claim that held them goes stale)."""
    claimed = {id(p) for b in opt.claimed_buckets() for p in b.params}
    free = [p for p in reversed(opt.all_params()) if id(p) not in claimed
            and (p.requires_grad or p.grad is not None or id(p) in opt.param_slots)]
    by_id = {id(p): p for p in free}
    groups = [names for kind in by_storage(free)
              for names in bucketize([(str(id(p)), p.numel()) for p in kind], opt.bucket_size)]
    # Pool buckets get negative indices so events never confuse them with a graph's planned buckets.
    return make_buckets(opt, [[by_id[int(k)] for k in names] for names in groups],
                        indices=[-1 - k for k in range(len(groups))])


def make_buckets(opt: "AdamW", param_lists: list[list[nn.Parameter]], indices: list[int],
                 sites: list[str] | None = None, flow: list[bool] | None = None,
                 link_dtypes: list[str] | None = None, cast_sites: list[str] | None = None) -> list[FlatBucket]:
    """Lay out ``param_lists`` as flat buckets numbered ``indices`` (with the plan's sites, flow modes, link
    dtypes and cast sites, when a compiled graph claims them): each adopts its parameters' state from wherever
    it is, and becomes where the optimizer finds them (``opt.param_slots``, the moments in ``opt.state``)."""
    made, shard = [], None
    if opt.sharding is not None:   # ZeRO: new buckets keep state for this rank's window only ...
        shard = (opt.sharding.rank, opt.sharding.world)
        # ... and state held by other ranks under the old layout is gathered first (same order everywhere)
        old = {id(b): b for params in param_lists for p in params if id(p) in opt.param_slots
               for b in (opt.param_slots[id(p)][0],)
               if b.sharded and (any(b.steps) or b.device_shard is not None)}   # device-side: the master too
        opt.sharding.unshard_state(list(old.values()))
    for k, (index, params) in enumerate(zip(indices, param_lists)):
        runtime = None
        if opt.host_master == "separate" and params:
            runtime = opt.runtimes.get(params[0].device, opt.runtime_kind)
        bucket = FlatBucket(index, params, shard=shard, host_master=opt.host_master,
                            site=sites[k] if sites else "cpu", flow=bool(flow and flow[k]), runtime=runtime,
                            link_dtype=link_dtypes[k] if link_dtypes else None,
                            cast_site=cast_sites[k] if cast_sites else "cpu", traffic=opt.traffic_ledger,
                            host_ledger=opt.host_ledger, moment_dtype=opt.moment_dtype,
                            host_blocks=opt.host_block_ledger,
                            # a device-site bucket's work is the device's (on the CPU build too): not booked
                            host_work=opt.host_work_ledger if (sites[k] if sites else "cpu") == "cpu" else None)
        bucket.adopt(opt.param_slots)
        bucket.group_of = [opt.group_index[id(p)] for p in params]
        bucket.use_rollback(opt.rollback)
        made.append(bucket)
    for bucket in made:
        for i, p in enumerate(bucket.params):
            opt.param_slots[id(p)] = (bucket, i)
            if p in opt.state:
                alias_state(bucket, i, opt.state[p])
    if opt.sharding is not None:   # device-side ZeRO: eager forwards wait for the buckets now holding their weights
        opt.sharding.laid_out(opt.param_slots)
    return made


def alias_state(bucket: FlatBucket, i: int, state: dict) -> None:
    """Point ``state``'s moments at the bucket's current buffers; a sharded bucket has no whole moment
    tensor to show, so its state holds the step count only (see socompile.distributed.checkpoint)."""
    if bucket.sharded:
        state.pop("exp_avg", None)
        state.pop("exp_avg_sq", None)
    else:
        state["exp_avg"] = bucket.view(bucket.exp_avg, i)
        state["exp_avg_sq"] = bucket.view(bucket.exp_avg_sq, i)
