"""ZeRO on the device for a bucket with a separate host master: each rank keeps 1/W of the bucket's host state.

    FlatBucket.shard(rank, world)        ->  narrow_to_device_shard: host buffers cut to this rank's chunk
    backward: receive (gradients gathered into one flat device buffer, in the weights' dtype)
    ZeroSharding.start_reduce            ->  reduce-scatter of that buffer, on the device (distributed/zero_device.py)
    land                                 ->  average, copy this rank's shard down into the host landing buffer
    CPU kernel steps the shard (master, moments, spare: chunk elements, ``FlatBucket.host`` indexes them)
    publish                              ->  the updated shard up (bf16 cast on the host), all-gather of the
                                             device weights (their dtype) before the next forward reads them
    weight-flow bucket (``flow``)        ->  nothing kept on the device: each prefetch (runtime/offload.py) uploads
                                             this rank's shard into its chunk of the fetched window and all-gathers
                                             the window in place (``upload_into``, zero_device.fetch_window); gradients
                                             are reduce-scattered in place, into this rank's chunk of the flat buffer

As DeepSpeed ZeRO-2 and FSDP2 do it: the gradients cross the link once per rank as a shard in the weights' dtype
(bf16 for a bf16 model), the updated weights cross it once per rank as a shard, and the collectives run on device
tensors (NCCL takes nothing else). Which buckets: a separate host master (``mirror``) stepped on the CPU, whose
runtime is CUDA (a GPU, or ``runtime="emulated"`` on a CPU, whose "device" tensors are CPU tensors that gloo
reduces), with an fp32 master, stationary or weight-flow (then as ZeRO-3 with offloaded parameters). The others
keep socompile.distributed.zero's host path (a CPU runtime's shared master IS the model's weights: it cannot be
cut; see docs/distributed.md).

Per rank, with chunk = ceil(numel / W) and padded = W * chunk (the collectives need W equal chunks):
  host:   master, exp_avg, exp_avg_sq (and the ping-pong spare's three) of chunk fp32 elements; the gradient
          landing buffer of chunk elements in the link dtype (bf16 for bf16 weights, else fp32: fp16 gradients are
          cast on the device after the reduction); bf16 / fp16 weights: a pinned stage of chunk elements in their
          dtype (the shard is cast on the host, half the bytes cross the link)
  device: the weights, padded to ``padded`` (the all-gather's output); the gradients of ``padded`` elements and
          the reduce-scatter's output of chunk elements, in the weights' dtype; the upload of chunk elements
          (the all-gather's input). A flow bucket keeps nothing: its fetched window (``padded`` elements, the
          plan's link dtype) lives from prefetch to release, and its reduce-scatter writes into its own gradient
          buffer. plan/memory.py counts the same (``zero_device_bytes``, ``host_memory``).
"""
from __future__ import annotations

import threading

import torch

from ..plan.bucket_buffers import (EXP_AVG_BUFFER, EXP_AVG_SQ_BUFFER, GRAD_BUFFER, LOW_STAGE_BUFFER,
                                   MASTER_BUFFER, shard_window)
from ..plan.bucketize import chunk_elements
from ..plan.host_work import HOST_CAST, copy_bytes
from .host_master import store_gradients
from .traffic import FLOW_FETCH, GRADIENTS as GRADIENT_LINK, WEIGHT_UPLOAD


GRADIENTS = "ZeRO gradient buffers"   # device ledger categories (runtime/memory.py)
SHARDS = "ZeRO shard buffers"


class ZeroPool:
    """What the device-sharded buckets of one runtime (one optimizer's device) share: the device ledger of their
    buffers, and the reductions in flight, so that at most two flat gradient buffers live at once without
    accumulation (one being filled by backward, one being reduced), as plan/memory.py counts them; and the
    collectives of the optimizer sharded over them (``collectives``: its socompile.distributed.zero.ZeroSharding,
    set by shard_optimizer), which a flow bucket's fetch all-gathers with."""

    def __init__(self):
        from .memory import DeviceLedger
        self.ledger = DeviceLedger()
        self.collectives = None
        self._reducing: list["DeviceShard"] = []   # shards whose reduce-scatter was issued, in issue order
        self._lock = threading.Lock()

    def use_collectives(self, sharding) -> None:
        """The optimizer over these buckets is sharded through ``sharding`` (a ZeroSharding): flow fetches
        all-gather with it, later claims too."""
        self.collectives = sharding

    def reducing(self, work, shard: "DeviceShard", bucket) -> None:
        shard.work, shard.landing = work, bucket
        with self._lock:
            self._reducing.append(shard)

    def settle(self, keep: int = 1) -> None:
        """Wait for every reduction but the last ``keep`` issued (gloo: they were issued a bucket's backward
        ago) and free their flat gradient buffers. Training thread only (the collectives' issuing thread)."""
        with self._lock:
            done, self._reducing = self._reducing[:max(0, len(self._reducing) - keep)], \
                self._reducing[max(0, len(self._reducing) - keep):]
        for shard in done:
            shard.wait_reduced()
            shard.release_grads()


def zero_pool(runtime) -> ZeroPool:
    """The runtime's ZeroPool, made on first use. It lives on the runtime object because the runtime is exactly
    the scope that shares it: one per optimizer and device (runtime/device.py ``Runtimes``)."""
    pool = getattr(runtime, "zero_pool", None)
    if pool is None:
        pool = runtime.zero_pool = ZeroPool()
    return pool


class DeviceShard:
    """The device buffers and link counters of one bucket's device-side ZeRO (``bucket.device_shard``).

    ``shard_buffer`` (chunk elements, the weights' dtype, kept): the reduce-scatter's output, the source of the
    gradient shard's D2H copy, then the destination of the updated shard's upload and the all-gather's input.
    ``grads`` (padded elements, the weights' dtype): made at the bucket's first gradient of an iteration, freed
    once its reduce-scatter is done (``ZeroPool.settle``)."""

    def __init__(self, bucket, rank: int, world: int, lo: int, hi: int):
        self.rank, self.world, self.lo, self.hi = rank, world, lo, hi
        self.index = bucket.index
        self.numel = bucket.numel
        self.chunk = chunk_elements(bucket.numel, world)
        self.padded = self.chunk * world
        self.dtype = bucket.dtype        # gradients are gathered and reduced in it: bf16 for a bf16 model
        self.runtime = bucket.runtime
        self.pool = zero_pool(self.runtime)
        self.flow = bucket.flow          # weights fetched for each use: no device buffer is kept
        self.grads = None
        self.work = None                 # the reduce-scatter in flight (gloo), waited and landed once (wait_reduced)
        self.landing = None              # the bucket whose reduced shard that reduce-scatter lands into
        self.gather = None               # the weights' all-gather in flight (distributed/zero_gather.py), waited
        #                                  once, by the first reader of the weights (wait_gathered)
        self._work_lock = threading.Lock()
        self.shard_buffer = None if self.flow else self.runtime.empty(self.chunk, self.dtype).zero_()
        self.reduced = None              # the reduce-scatter's output (shard_buffer; flow: a chunk of grads)
        # bf16 / fp16 weights: the shard cast on the host (bucket_buffers lays it out at the bucket's chunk)
        self.stage = bucket.make_buffer(LOW_STAGE_BUFFER, zeroed=False) \
            if bucket.has_buffer(LOW_STAGE_BUFFER) else None
        self.pool.ledger.alloc(SHARDS, id(self), self.fixed_device_bytes())

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    def fixed_device_bytes(self) -> int:
        """Device bytes kept for the bucket's whole life: the shard buffer and the weights' padding to W chunks
        (none for a flow bucket: its weights hold nothing between uses)."""
        return 0 if self.flow else self.element_size * (self.chunk + self.padded - self.numel)

    def close(self) -> None:
        self.wait_gathered()
        self.release_grads()
        self.pool.ledger.free(SHARDS, id(self))

    # ------------------------------------------------------------------ gradients
    def receive(self, bucket, segments: list[int], grads: list[torch.Tensor], accumulate: bool) -> None:
        """Gather gradients into the flat device buffer (device-side copies or adds, on the compute stream),
        made zeroed at the iteration's first gradient (a parameter without one adds nothing)."""
        if self.grads is None:
            self.pool.settle(keep=1)   # at most one other flat buffer stays: the one being reduced
            self.grads = self.runtime.empty(self.padded, self.dtype).zero_()
            self.pool.ledger.alloc(GRADIENTS, id(self), self.grads.numel() * self.element_size)
        store_gradients(lambda i: self.grads[bucket.segment(i)], bucket.has_grad, segments, grads, accumulate)

    def reduce_output(self) -> torch.Tensor:
        """Where the reduce-scatter puts this rank's summed chunk: the kept shard buffer, or (flow: nothing kept)
        this rank's chunk of the flat gradient buffer itself (an in-place reduce-scatter, which NCCL and gloo
        allow)."""
        mine = slice(self.rank * self.chunk, (self.rank + 1) * self.chunk)
        self.reduced = self.grads[mine] if self.flow else self.shard_buffer
        return self.reduced

    def wait_reduced(self) -> None:
        """Wait for the reduce-scatter in flight and land it, from the CPU worker (which steps it next) or the
        training thread (to free the flat buffer), whichever comes first; one thread waits on the work, the other
        on this lock. Landing before the buffer is freed keeps a flow bucket's in-place output alive for its copy."""
        with self._work_lock:
            if self.work is not None:
                self.work.wait()
                self.work = None
                self.land(self.landing)
                self.landing = None

    def release_grads(self) -> None:
        if self.grads is not None:
            self.grads = None
            self.pool.ledger.free(GRADIENTS, id(self))

    def land(self, bucket) -> None:
        """After the reduce-scatter: average on the device and copy this rank's shard into the host landing
        buffer (``bucket.grad``) on the "d2h" stream; ``bucket.wait_grads`` waits for it."""
        reduced, self.reduced = self.reduced, None
        reduced.div_(self.world)   # gloo has no AVG; NCCL's would round the same way for W = 2^k
        if reduced.dtype != bucket.grad.dtype:   # fp16: cast to the fp32 landing dtype here, on the device, so
            reduced = reduced.to(bucket.grad.dtype)   # what crosses is what lands (dtypes.gradient_link_name)
        rt = self.runtime
        bucket.gradients_landing(rt.copy_async(bucket.grad, reduced, rt.stream("d2h")))
        bucket.traffic.add_copy("d2h", GRADIENT_LINK, reduced)   # opt.traffic(): plan/transfers.py counts it

    # ------------------------------------------------------------------- weights
    def gathering(self, pending) -> None:
        """The weights' all-gather ``pending`` (distributed/zero_gather.py PendingGather) is in flight; the first
        reader of the weights waits for it (``wait_gathered``)."""
        self.gather = pending

    def wait_gathered(self) -> bool:
        """Wait for the weights' all-gather in flight, if any (NCCL: the current stream waits; gloo: this thread
        blocks until done); True when there was one. Training thread only."""
        pending, self.gather = self.gather, None
        if pending is None:
            return False
        pending.wait()
        return True

    def upload_shard(self, bucket) -> None:
        """The master shard, cast to the weights' dtype on the host (bf16: the pinned stage), into the shard
        buffer on the "h2d" stream; the compute stream waits for it (the all-gather or the window copy reads it)."""
        self.wait_gathered()              # the previous all-gather read the shard buffer and writes the weights
        bucket.master_changed()           # the step wrote the master: the stage is cast again (host_source)
        bucket.wait_grads()               # the gradient shard's D2H copy read the shard buffer
        rt = self.runtime
        event = rt.copy_async(self.shard_buffer, self.host_source(bucket, self.dtype), rt.stream("h2d"))
        bucket.traffic.add_copy("h2d", WEIGHT_UPLOAD, self.shard_buffer)
        rt.wait_on_compute(event)
        bucket.upload_issued(event, compute_waits=True)
        bucket.weights_current()

    def host_source(self, bucket, dtype: torch.dtype) -> torch.Tensor:
        """What an upload of the shard in ``dtype`` reads: bf16, the pinned bf16 stage of the master shard (cast on
        the host when the master changed since: half the bytes cross); else the master shard
        (the copy converts)."""
        if self.stage is None or dtype != self.stage.dtype:
            return bucket.master
        if not bucket.low_in_sync():
            bucket.before_host_write()    # the previous upload read the stage: it must be done
            self.stage.copy_(bucket.master)
            bucket.host_work.add_work(HOST_CAST, copy_bytes(bucket.master.numel(), bucket.master.element_size(),
                                                            self.stage.element_size()))
            bucket.low_synced()
        return self.stage

    def upload_into(self, bucket, window: torch.Tensor) -> tuple[torch.Tensor, object]:
        """A flow bucket's prefetch: this rank's master shard, in ``window``'s dtype (the plan's link dtype), up
        into this rank's chunk of ``window`` (``padded`` elements) on the "h2d" stream; the all-gather fills the
        rest (zero_device.fetch_window). Returns (that chunk, the copy's event); the next kernel step waits for it
        before it rewrites the master (``before_host_write``)."""
        mine = window[self.rank * self.chunk:(self.rank + 1) * self.chunk]
        src = self.host_source(bucket, window.dtype)
        rt = self.runtime
        event = rt.copy_async(mine, src, rt.stream("h2d"))
        bucket.traffic.add_copy("h2d", FLOW_FETCH, mine)
        bucket.upload_issued(event, compute_waits=True)
        return mine, event

    def refresh_window(self, bucket) -> None:
        """``upload()`` without a collective (a rollback, a load): this rank's window of the device weights
        from its master shard; the other ranks' windows are theirs (the all-gather of ``publish`` fills them).
        A flow bucket has no device weights to refresh: its next fetch reads the master (the stage is re-cast)."""
        if self.flow:
            bucket.master_changed()
            bucket.weights_current()
            return
        self.upload_shard(bucket)
        bucket.weights[self.lo:self.hi].copy_(self.shard_buffer[:self.hi - self.lo])

    def gather_weights(self, bucket) -> None:
        """Fill a flow bucket's (re-sized) device weights whole: a fetch outside a graph (``materialized``, a
        collective: every rank materializes its buckets in the same order)."""
        window = self.runtime.empty(self.padded, bucket.dtype)
        self.pool.collectives.fetch_window(bucket, window)()
        bucket.weights.copy_(window[:self.numel])


def narrow_to_device_shard(bucket, rank: int, world: int) -> None:
    """Cut ``bucket``'s host state to this rank's chunk and give it its device buffers (``DeviceShard``):
    master, moments and gradient landing buffer hold elements [lo, lo + chunk) of the bucket (zero past its
    end), and the device weights are padded to W chunks for the all-gather (parameters re-pointed into them)."""
    bucket.wait_upload_on_compute()
    bucket.before_host_write()
    bucket.wait_grads()
    lo, hi = shard_window(bucket.numel, rank, world)
    shard = DeviceShard(bucket, rank, world, lo, hi)
    pending = any(bucket.has_grad) and bucket.arrivals > 0   # mid-accumulation: the sums so far go to the device
    if pending:
        shard.receive(bucket, [], [], accumulate=True)   # makes the flat buffer
        shard.grads[:bucket.numel].copy_(bucket.grad)

    def cut(whole: torch.Tensor, name: str) -> torch.Tensor:
        mine = bucket.make_buffer(name)   # the chunk's, as bucket_buffers lays it out (bucket.rank_world)
        mine[:hi - lo].copy_(whole[lo:hi])
        return mine

    # whole until now; the master is read by the shard's upload only when the weights are not bf16 (bf16 weights
    # go up from the pinned bf16 stage, cast on the host: this path's one cast site)
    weights = None
    if not bucket.flow:   # a flow bucket's weights hold nothing between uses: its fetches gather whole windows
        weights = bucket.runtime.empty(shard.padded, bucket.dtype)
        weights[:bucket.numel].copy_(bucket.weights)
        weights[bucket.numel:].zero_()
    bucket.take_device_shard(shard, master=cut(bucket.master, MASTER_BUFFER),
                             grad=bucket.make_buffer(GRAD_BUFFER),   # the device reduces in the weights' dtype
                             exp_avg=cut(bucket.exp_avg, EXP_AVG_BUFFER),
                             exp_avg_sq=cut(bucket.exp_avg_sq, EXP_AVG_SQ_BUFFER), weights=weights)


def widen_from_gathered(bucket, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    """Undo ``narrow_to_device_shard`` with whole buffers gathered from every rank (a new bucket layout adopts
    from them: ZeroSharding.unshard_state). Gradients still being accumulated on the device come down whole."""
    shard = bucket.device_shard
    n = bucket.numel
    grad = torch.zeros(n, dtype=bucket.state_dtype)
    if any(bucket.has_grad) and bucket.arrivals > 0 and shard.grads is not None:
        grad.copy_(shard.grads[:n])
    bucket.drop_device_shard(master=master[:n], grad=grad, exp_avg=exp_avg[:n], exp_avg_sq=exp_avg_sq[:n])
    shard.close()
