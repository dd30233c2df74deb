"""ZeRO-style data parallelism for socompile.AdamW: each rank owns one shard of every bucket.

    opt = socompile.AdamW(model.parameters(), ..., max_grad_norm=1.0)
    zero.shard_optimizer(opt, topo.world_group)      # after building opt, before the first step

Per bucket (the optimizer's flat fp32 buffers; padded to a multiple of the world size W because gloo checks
dim 0 and chunks must be equal)::

    backward: bucket's gradients complete          (socompile::bucket_grads_ready, in graph order)
      -> reduce_scatter_single(sum)  async        shard r of sum_ranks(grad) lands on rank r
    CPU worker: wait, divide by W                   (gloo has no PREMUL_SUM/AVG: we divide ourselves)
      -> stats + (speculative) AdamW step on elements [lo, hi) only   (FlatBucket.window)
    opt.step(): all_reduce([sum of squares, non-finite])   so every rank validates alike
      -> commit / skip / redo-with-clip, each on its own shard
      -> all_gather_single(master[lo:hi])  -> every rank's full fp32 weights (the model aliases them)
      -> separate host master (GPU / bf16 parameters): the whole master is uploaded into the device weights

Separate host master: the reduce-scatter reads the host ``grad`` once the device gradients' copy-in is done
(``FlatBucket.wait_grads``) and the all-gather marks the master changed (``FlatBucket.master_changed``), so the
upload in ``opt.step()`` casts all of it, not only this rank's window (see runtime/flat_bucket.py).

NOTE: collective order. gloo (and NCCL) match collectives by issue order, so every collective here is issued
from the training thread: reduce-scatters in backward-graph order (identical on every rank), the rest in
``step()`` in bucket order. The CPU worker thread only *waits* on reduce-scatters already issued.

Sharding the world group (dp x sp) is right for Ulysses too: sequence-parallel ranks see different tokens of
the same sequences, so their gradients must be averaged like data-parallel ones (equal shard sizes).

Device-side ZeRO (``zero_device.py``, runtime/sharded_bucket.py): a separate host master on a CUDA runtime (a GPU,
or the emulated device) is reduce-scattered from the device gradients in the weights' dtype, lands as this rank's
shard only, and the device weights are all-gathered from the uploaded shards; its master, gradients and state are
1/W per rank. The hooks below hand such buckets (``bucket.device_shard``) to zero_device.py; the rest of this
docstring describes the host path, which the other buckets take (a CPU runtime's shared master IS the weights).

Memory: each rank allocates exp_avg, exp_avg_sq and the ping-pong spare (master window and moments) for its
window only (``FlatBucket.shard``): optimizer state is ~1/W of one process's. The fp32 weights (``master``, the
model aliases them) and the gradient buffer (backward writes whole gradients; it is the reduce-scatter's input)
stay whole. ``opt.state_dict()`` refuses (it would show moments it does not have): checkpoints go through
torch.distributed.checkpoint (``socompile.distributed.checkpoint``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..optim.bucket_layout import alias_state
from ..plan.bucketize import chunk_elements
from ..plan.host_work import GATHER_COPIES, REDUCE_COPIES, copy_bytes
from ..runtime.host_master import upload_order
from ..runtime.sharded_bucket import widen_from_gathered, zero_pool
from . import zero_device, zero_gather
from .faults import agree_across_ranks, field_hashes, guard


@dataclasses.dataclass
class CommStats:
    """Payload handed to collectives by this rank, and the bytes a bandwidth-optimal (ring) algorithm sends
    per rank for it: (W-1)/W of the buffer for reduce-scatter and all-gather, 2(W-1)/W for all-reduce."""

    steps: int = 0
    reduce_scatter_bytes: int = 0      # full (padded) input buffers
    all_gather_bytes: int = 0          # full (padded) output buffers
    all_reduce_bytes: int = 0
    sent_bytes: float = 0.0            # ring estimate, per rank

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Shard:
    lo: int
    hi: int
    chunk: int            # elements per rank (padded numel / W)
    padded: int


class ZeroSharding:
    def __init__(self, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stats = CommStats()
        self._inflight: dict[int, tuple] = {}    # id(bucket) -> (work, received shard, bucket)
        self._reduced: set[int] = set()          # ids of buckets whose shard holds reduced gradients now
        self.stream_ordered = zero_device.stream_ordered(group)   # NCCL: waits order streams (zero_device.py)
        self.eager_reads = None                  # device-side ZeRO: forward pre-hooks that wait for all-gathers

    # ---------------------------------------------------------------- layout
    def laid_out(self, slot: dict) -> None:
        """The optimizer laid buckets out (again): an eager forward waits for the buckets now holding its
        module's parameters (``slot``: the optimizer's parameter -> (bucket, segment) index; zero_gather.py)."""
        if self.eager_reads is not None:
            self.eager_reads.index(slot)

    def shard_of(self, bucket) -> _Shard:
        bucket.shard(self.rank, self.world)   # no-op once sharded (buckets made after shard_optimizer are)
        chunk = chunk_elements(bucket.numel, self.world, bucket.zero_block)
        return _Shard(*bucket.window, chunk, chunk * self.world)

    def unshard_state(self, buckets) -> None:
        """Gather the whole moments of sharded ``buckets`` onto every rank (all-gather; a transient full copy
        of those buckets' state), so that a new bucket layout (a compile claiming parameters after a load or
        after steps) can take its windows from them. Called with the same buckets, in the same order, on every
        rank (the optimizer's layouts are the same everywhere; the plan check says so)."""
        if buckets:   # sizes first, by a fixed-size collective: gloo aborts an all-gather of unequal sizes
            sizes = {f"optimizer.buckets[{b.index}].numel": b.numel for b in buckets}
            agree_across_ranks("re-layout check", field_hashes(sizes), sizes, self.group,
                               "ranks re-lay out different optimizer buckets (their optimizers or plans differ); "
                               "every rank must build the same optimizer and compile with the same options.")
        for bucket in buckets:
            if bucket.device_shard is not None:   # master and moments are sharded: all of them come back whole
                bucket.device_shard.wait_gathered()   # its weights' all-gather: issued, so waited, on every rank
                widen_from_gathered(bucket, *zero_device.gather_whole(self, bucket))
                continue
            shard = self.shard_of(bucket)
            full = []
            # int8 moments: a chunk is whole blocks (zero_block), so the ranks' bytes concatenate to the bucket's
            chunk = bucket.moment_buffer_elements(shard.chunk)
            for name, local in (("exp_avg", bucket.exp_avg), ("exp_avg_sq", bucket.exp_avg_sq)):
                mine = torch.zeros(chunk, dtype=local.dtype)
                mine[:local.numel()].copy_(local)
                out = torch.empty(chunk * self.world, dtype=local.dtype)
                with guard(f"all-gather of bucket {bucket.index}'s {name} (re-layout)", self.group), \
                        zero_device.staged(out, self.group) as dst, zero_device.staged(mine, self.group) as src:
                    dist.all_gather_single(dst, src, group=self.group) if hasattr(dist, "all_gather_single") \
                        else dist.all_gather_into_tensor(dst, src, group=self.group)
                full.append(out[:bucket.moment_buffer_elements(bucket.numel)])
            bucket.unshard(*full)

    def fetch_window(self, bucket, window):
        """A device-sharded flow bucket's fetch into ``window`` (zero_device.fetch_window); returns its wait."""
        return zero_device.fetch_window(self, bucket, window)

    def ring_bytes(self, nbytes: int, factor: float = 1.0) -> float:
        return factor * nbytes * (self.world - 1) / self.world

    # ------------------------------------------------------------- gradients
    def start_reduce(self, bucket) -> None:
        """Issue the bucket's reduce-scatter (async). Training thread only: collectives match by issue order."""
        if id(bucket) in self._inflight or id(bucket) in self._reduced:
            return
        if bucket.device_shard is not None:   # the device gradients, reduced on the device (zero_device.py)
            self._inflight[id(bucket)] = (zero_device.start(self, bucket), None, bucket)
            return
        shard = self.shard_of(bucket)
        # Separate host master: the copy-in of the device gradients (CUDA: async on the "d2h" stream, and staged
        # micro-batches still to add) must have landed in the host ``grad`` before the collective reads it.
        # NOTE: on CUDA only float64 state takes this host path (plan/bucket_buffers.py shard_layout "chunk":
        # an fp32 master is reduced on the device, above); it blocks the training thread on that copy and reduces
        # on the host (gloo).
        bucket.wait_grads()
        send = bucket.grad
        if shard.padded != bucket.numel or send.dtype != bucket.state_dtype:   # a bf16 landing buffer: sum in fp32
            send = torch.zeros(shard.padded, dtype=bucket.state_dtype)
            send[:bucket.numel].copy_(bucket.grad)
            bucket.host_work.add_work(REDUCE_COPIES, (0, send.numel() * send.element_size()))   # the zeros
            bucket.host_work.add_work(REDUCE_COPIES, copy_bytes(bucket.numel, bucket.grad.element_size(),
                                                                send.element_size()))
        recv = torch.empty(shard.chunk, dtype=bucket.state_dtype)
        with guard(f"reduce-scatter of bucket {bucket.index}", self.group):
            work = dist.reduce_scatter_single(recv, send, op=dist.ReduceOp.SUM, group=self.group, async_op=True) \
                if hasattr(dist, "reduce_scatter_single") else \
                dist.reduce_scatter_tensor(recv, send, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        nbytes = send.numel() * send.element_size()
        self.stats.reduce_scatter_bytes += nbytes
        self.stats.sent_bytes += self.ring_bytes(nbytes)
        self._inflight[id(bucket)] = (work, recv, bucket)

    def finish_reduce(self, bucket) -> None:
        """Wait for the bucket's reduce-scatter and put the averaged shard into its gradient buffer. Safe from
        the CPU worker thread (waits only). Elements outside the shard keep this rank's local gradients."""
        entry = self._inflight.pop(id(bucket), None)
        if entry is None:
            return
        work, recv, _ = entry
        if bucket.device_shard is not None:
            zero_device.finish(bucket, work, self.group)
            self._reduced.add(id(bucket))
            return
        with guard(f"reduce-scatter of bucket {bucket.index} (wait)", self.group):
            work.wait()
        shard = self.shard_of(bucket)
        recv.div_(self.world)
        bucket.take_reduced_shard(shard.lo, recv[:shard.hi - shard.lo])
        size = recv.element_size()
        bucket.host_work.add_work(REDUCE_COPIES, copy_bytes(recv.numel(), size, size))   # the division
        bucket.host_work.add_work(REDUCE_COPIES, copy_bytes(shard.hi - shard.lo, size, bucket.grad.element_size()))
        self._reduced.add(id(bucket))

    def discard(self, buckets) -> None:
        """zero_grad() without step(): the iteration's reductions are abandoned. Each reduce-scatter its backward
        issued is waited for (every rank issued the same ones, and collectives complete in issue order) and
        dropped with the device path's flat gradient buffer, so the next backward reduces afresh."""
        for bucket in buckets:
            self.finish_reduce(bucket)
            if bucket.device_shard is not None:
                bucket.device_shard.release_grads()
        self._reduced.clear()

    def reduce_remaining(self, buckets) -> None:
        """In step(): reduce buckets whose gradients came from ``.grad`` (eager use), in bucket order."""
        for bucket in buckets:
            if any(bucket.has_grad):
                self.start_reduce(bucket)
        for bucket in buckets:
            self.finish_reduce(bucket)

    # ------------------------------------------------------------ validation
    def global_stats(self, sumsq: float, nonfinite: bool) -> tuple[float, bool]:
        """Sum the shards' squared-norm partials and OR their non-finite flags over all ranks (float64)."""
        both = torch.tensor([sumsq if not nonfinite else 0.0, 1.0 if nonfinite else 0.0], dtype=torch.float64)
        with guard("all-reduce of the gradient norm", self.group), zero_device.staged(both, self.group) as sent:
            dist.all_reduce(sent, op=dist.ReduceOp.SUM, group=self.group)
        self.stats.all_reduce_bytes += both.numel() * both.element_size()
        self.stats.sent_bytes += self.ring_bytes(both.numel() * both.element_size(), 2.0)
        return float(both[0]), bool(both[1] > 0)

    # --------------------------------------------------------------- weights
    def gather(self, buckets, changed: bool = True) -> None:
        """All-gather every bucket's updated master shard, so each rank has the full new weights."""
        self.stats.steps += 1
        self._reduced.clear()
        for bucket in buckets:   # device-side ZeRO: every reduction is done; free the flat gradient buffers
            if bucket.device_shard is not None:
                bucket.device_shard.pool.settle(keep=0)
                break
        if not changed:   # skipped step: no rank changed its shard
            return
        for bucket in upload_order(buckets):   # the order the next forward reads them (the same on every rank)
            if not any(bucket.has_grad):
                continue
            if bucket.device_shard is not None:   # upload the shard, issue the device weights' all-gather
                zero_device.publish(self, bucket)   # waited by the weights' first reader (zero_gather.py)
                continue
            shard = self.shard_of(bucket)
            mine = torch.zeros(shard.chunk, dtype=bucket.master.dtype)
            mine[:shard.hi - shard.lo].copy_(bucket.master[shard.lo:shard.hi])
            full = torch.empty(shard.padded, dtype=bucket.master.dtype)
            with guard(f"all-gather of bucket {bucket.index}", self.group), \
                    zero_device.staged(full, self.group) as dst, zero_device.staged(mine, self.group) as src:
                if hasattr(dist, "all_gather_single"):
                    dist.all_gather_single(dst, src, group=self.group)
                else:
                    dist.all_gather_into_tensor(dst, src, group=self.group)
            bucket.before_host_write()   # separate master, CUDA: an upload still reading the master is done
            bucket.master.copy_(full[:bucket.numel])
            size = bucket.master.element_size()
            for work in ((0, mine.numel() * size), copy_bytes(shard.hi - shard.lo, size, size),
                         copy_bytes(bucket.numel, size, size)):   # the zeros, the window, the gathered master
                bucket.host_work.add_work(GATHER_COPIES, work)
            if bucket.mirror:   # the device weights (a flow bucket: the bf16 stage) are cast again from all of it
                bucket.master_changed()
            nbytes = full.numel() * full.element_size()
            self.stats.all_gather_bytes += nbytes
            self.stats.sent_bytes += self.ring_bytes(nbytes)


@torch.no_grad()
def shard_optimizer(optimizer, group=None, broadcast_from: int | None = 0) -> ZeroSharding:
    """Shard ``optimizer`` (a socompile.AdamW) over ``group``: gradients are reduce-scattered and averaged,
    each rank steps its shard, weights are all-gathered. Parameters are first broadcast from
    ``broadcast_from`` (group rank) so every rank starts from the same weights (None: trust the caller)."""
    from ..optim.adamw import AdamW

    if not isinstance(optimizer, AdamW):
        raise TypeError(f"shard_optimizer needs a socompile.AdamW, got {type(optimizer).__name__}")
    if optimizer.sharding is not None:
        raise RuntimeError("this optimizer is already sharded")
    sharding = ZeroSharding(group)
    if sharding.world > 1:
        check_same_optimizer(optimizer, group)   # before the first collective over its buckets
    if broadcast_from is not None and sharding.world > 1:
        source = dist.get_global_rank(group, broadcast_from) if group is not None else broadcast_from
        with guard("broadcast of the initial weights", group):
            for bucket in optimizer.buckets:
                bucket.before_host_write()
                with zero_device.staged(bucket.master, group) as master:
                    dist.broadcast(master, src=source, group=group)
                if bucket.mirror:   # separate master: every rank's device weights from the broadcast master
                    bucket.master_changed()
        optimizer.upload_buckets(optimizer.buckets)
    optimizer.wait_pending()
    for bucket in optimizer.buckets:   # from now on each rank keeps optimizer state for its windows only
        bucket.shard(sharding.rank, sharding.world)
    optimizer.use_sharding(sharding)
    for runtime in {id(b.runtime): b.runtime for b in optimizer.buckets if b.runtime is not None}.values():
        zero_pool(runtime).use_collectives(sharding)   # flow buckets' fetches all-gather through it (later claims too)
    if sharding.world > 1 and optimizer.host_master == "separate" and optimizer.runtime_kind in ("cuda", "emulated"):
        # device-side ZeRO: step() leaves the weights' all-gathers in flight; an eager forward waits first
        sharding.eager_reads = zero_gather.EagerReadWaits(optimizer)
    for bucket in optimizer.buckets:
        for i, p in enumerate(bucket.params):
            if p in optimizer.state:
                alias_state(bucket, i, optimizer.state[p])
    return sharding


def check_same_optimizer(optimizer, group=None) -> str:
    """Raise PlanMismatchError on every rank, naming the differing arguments with each rank's value, unless every
    rank of ``group`` built the same optimizer: the same bucket layout (bucket_size, each bucket's size), parameter
    shapes and hyper-parameters. Collectives over buckets of different sizes would abort or hang instead."""
    summary = {"optimizer.bucket_size": optimizer.bucket_size, "optimizer.max_grad_norm": optimizer.max_grad_norm,
               "optimizer.buckets.count": len(optimizer.buckets),
               **{f"optimizer.buckets[{b.index}].numel": b.numel for b in optimizer.buckets}}
    for i, group_dict in enumerate(optimizer.param_groups):
        summary[f"optimizer.param_groups[{i}].shapes"] = [list(p.shape) for p in group_dict["params"]]
        summary.update({f"optimizer.param_groups[{i}].{k}": v for k, v in group_dict.items() if k != "params"})
    return agree_across_ranks("shard_optimizer's layout check", field_hashes(summary), summary, group,
                              "ranks built different socompile.AdamW optimizers (different arguments or models?): "
                              "their buckets cannot be sharded together. Every rank must build the same optimizer "
                              "over the same model.")
