"""How socompile.AdamW lays its parameters out in flat buckets (runtime/flat_bucket.py): ``BucketStore`` holds the
claims of the compiled graphs, the pool of parameters no claim holds (bucketed by size) and each parameter's slot,
and makes the buckets of a layout (the pool's, or a claim's from the plan).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..plan.bucketize import bucketize
from ..runtime.device import Runtimes
from ..runtime.flat_bucket import FlatBucket, real_dtype
from ..runtime.memory import HostLedger
from ..runtime.traffic import HostBlockLedger, HostWorkLedger, TrafficLedger
from .graph_claim import Claims


def by_storage(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` split by what one flat bucket can hold together (one real dtype, one device), in order of
    first appearance; a model of one dtype is one list."""
    kinds: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        kinds.setdefault((real_dtype(p.dtype), p.device), []).append(p)
    return list(kinds.values())


@dataclasses.dataclass(frozen=True)
class BucketSettings:
    """What every bucket of one optimizer is made with (its constructor's arguments, resolved)."""
    host_master: str          # "shared" or "separate"
    rollback: str             # the default rollback mode, "pingpong" or "inverse"
    moment_dtype: torch.dtype
    bucket_size: int          # bytes, of the pool's buckets
    runtime_kind: str         # "cpu", "cuda" or "emulated" (runtime/device.py resolve_runtime)


class BucketStore:
    """socompile.AdamW's buckets and where each parameter is: the buckets of the compiled graphs' claims
    (graph_claim.py), the pool of the parameters no active claim holds, each parameter's slot (bucket, index in
    it) and param group. ``runtimes`` and the ledgers are the optimizer's: every bucket made here books in them."""

    def __init__(self, settings: BucketSettings, runtimes: Runtimes, *, traffic: TrafficLedger,
                 host_ledger: HostLedger, host_work: HostWorkLedger, host_blocks: HostBlockLedger):
        self.settings = settings
        self.slots: dict[int, tuple[FlatBucket, int]] = {}   # id(parameter): (its bucket, its index there)
        self.group_index: dict[int, int] = {}                # id(parameter): its param group
        self.claims = Claims()
        self._pool: list[FlatBucket] = []
        self._runtimes = runtimes
        # the ledgers every bucket made here books into (host_work: CPU-stepped buckets only)
        self._traffic, self._host_ledger, self._host_blocks = traffic, host_ledger, host_blocks
        self._host_work = host_work

    def buckets(self) -> list[FlatBucket]:
        """Every bucket in use: the active claims', then the pool's."""
        return self.claimed_buckets() + self._pool

    def claimed_buckets(self) -> list[FlatBucket]:
        return [b for claim in self.claims.active() for b in claim.buckets]

    def pool(self) -> list[FlatBucket]:
        return list(self._pool)

    def join_group(self, p: nn.Parameter, group: int) -> None:
        """``p`` belongs to param group ``group`` of the optimizer."""
        self.group_index[id(p)] = group

    def rebuild_pool(self, params: list[nn.Parameter], sharding, state: dict) -> None:
        """Bucket every parameter of ``params`` no active claim holds, in reverse registration order (the usual
        order of gradients in backward): trainable ones, and frozen ones that were bucketed before (their state is
        kept, and their weights stay in place when the claim that held them goes stale)."""
        claimed = {id(p) for b in self.claimed_buckets() for p in b.params}
        free = [p for p in reversed(params) if id(p) not in claimed
                and (p.requires_grad or p.grad is not None or id(p) in self.slots)]
        by_id = {id(p): p for p in free}
        groups = [names for kind in by_storage(free)
                  for names in bucketize([(str(id(p)), p.numel()) for p in kind], self.settings.bucket_size)]
        # Pool buckets get negative indices so events never confuse them with a graph's planned buckets.
        self._pool = self.make([[by_id[int(k)] for k in names] for names in groups], sharding, state,
                               indices=[-1 - k for k in range(len(groups))])

    def make(self, param_lists: list[list[nn.Parameter]], sharding, state: dict, indices: list[int],
             sites: list[str] | None = None, flow: list[bool] | None = None,
             link_dtypes: list[str] | None = None, cast_sites: list[str] | None = None) -> list[FlatBucket]:
        """Lay out ``param_lists`` as flat buckets numbered ``indices`` (with the plan's sites, flow modes, link
        dtypes and cast sites, when a compiled graph claims them): each adopts its parameters' state from wherever
        it is, and becomes where the optimizer finds them (``slots``, the moments in ``state``: ``opt.state``).
        ``sharding``: the optimizer's ZeRO sharding, or None."""
        settings, made, shard = self.settings, [], None
        if sharding is not None:   # ZeRO: new buckets keep state for this rank's window only ...
            shard = (sharding.rank, sharding.world)
            # ... and state held by other ranks under the old layout is gathered first (same order everywhere)
            old = {id(b): b for params in param_lists for p in params if id(p) in self.slots
                   for b in (self.slots[id(p)][0],)
                   if b.sharded and (any(b.steps) or b.device_shard is not None)}   # device-side: the master too
            sharding.unshard_state(list(old.values()))
        for k, (index, params) in enumerate(zip(indices, param_lists)):
            runtime = None
            if settings.host_master == "separate" and params:
                runtime = self._runtimes.get(params[0].device, settings.runtime_kind)
            site = sites[k] if sites else "cpu"
            bucket = FlatBucket(index, params, shard=shard, host_master=settings.host_master, site=site,
                                flow=bool(flow and flow[k]), runtime=runtime,
                                link_dtype=link_dtypes[k] if link_dtypes else None,
                                cast_site=cast_sites[k] if cast_sites else "cpu", moment_dtype=settings.moment_dtype,
                                # a device-site bucket's work is the device's (on the CPU build too): not booked
                                host_work=self._host_work if site == "cpu" else None,
                                traffic=self._traffic, host_ledger=self._host_ledger, host_blocks=self._host_blocks,
                                groups=[self.group_index[id(p)] for p in params])
            bucket.adopt(self.slots)
            bucket.use_rollback(settings.rollback)
            made.append(bucket)
        for bucket in made:
            for i, p in enumerate(bucket.params):
                self.slots[id(p)] = (bucket, i)
                if p in state:
                    alias_state(bucket, i, state[p])
        if sharding is not None:   # device-side ZeRO: eager forwards wait for the buckets now holding their weights
            sharding.laid_out(self.slots)
        return made


def alias_state(bucket: FlatBucket, i: int, state: dict) -> None:
    """Point ``state``'s moments at the bucket's current buffers; a sharded bucket has no whole moment
    tensor to show, so its state holds the step count only (see socompile.distributed.checkpoint)."""
    if bucket.sharded:
        state.pop("exp_avg", None)
        state.pop("exp_avg_sq", None)
    else:
        # int8 moments: the parameter's packed blocks (socompile/moment_format.py); state_dict() decodes them
        state["exp_avg"] = bucket.moment_part(bucket.exp_avg, i)
        state["exp_avg_sq"] = bucket.moment_part(bucket.exp_avg_sq, i)
