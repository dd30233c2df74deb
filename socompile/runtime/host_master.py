"""The copies between a bucket's host master and its device: gradients in, the updated master out.

NOTE: host master, "shared" or "separate" (mirror). Shared (the default for fp32 CPU parameters): the parameters
alias ``master`` (runtime/flat_bucket.py). Separate (parameters on a GPU, or not fp32, or forced): the bucket
keeps a flat ``weights`` buffer in the parameters' own dtype and device, and each parameter's ``.data`` is a view
of it (one copy per bucket moves them); ``master``, ``grad``, the moments and the spare stay on the host (pinned
on CUDA). Gradients arriving from the device are copied into the host ``grad`` (``receive_many``: on CUDA a
non_blocking copy on the runtime's "d2h" stream whose event the CPU step waits on, ``wait_grads``; on the CPU a
plain copy), and once a step is final ``upload`` casts the master into ``weights`` (on CUDA a non_blocking copy
on the "h2d" stream, issued as soon as this bucket's step is final; the compute stream waits for its event right
before the next forward's first read of the bucket, ``socompile::wait_upload`` of passes/wait_uploads.py, or at
the end of ``opt.step()`` for a bucket no compiled forward waits for, ``graph_waits_upload``). A ping-pong commit
then swaps ``master`` only: parameters stay views of ``weights``. Weight-flow buckets (``flow``) keep no device
bytes between uses: the storage of ``weights`` is resized to 0 (as FSDP2 does; tensor metadata stays, so Dynamo's
guards still match), and each use fetches the master (runtime/offload.py). A device-stepped bucket (``site ==
"device"``) keeps master, gradient and moments on the device; its parameters alias ``master`` when they are fp32,
else ``weights`` is a device copy cast from ``master`` after each step.

``HostMasterCopies`` is the part of ``FlatBucket`` (runtime/flat_bucket.py, which inherits it) that does these
copies; it uses the bucket's layout (``master``, ``grad``, ``numel``, ``segment``, ``view``, ``params``,
``has_grad``) and placement (``mirror``, ``site``, ``flow``, ``runtime``, ``dtype``, ``device``).
"""
from __future__ import annotations

import contextlib

import torch

from . import ranges
from ..plan.bucket_buffers import ACCUMULATION_BUFFER, LOW_STAGE_BUFFER, WEIGHTS_BUFFER
from ..plan.host_work import (ACCUMULATION_ADD, GRADIENT_COPY, HOST_CAST, UPLOAD_COPY, add_bytes,
                              copy_bytes)
from .traffic import GRADIENTS, WEIGHT_UPLOAD


class UploadStaging:
    """The device's fp32 upload staging of a graph's device-cast buckets (runtime/memory.py "upload staging";
    plan/memory.py ``upload_staging_bytes``): two buffers of the largest such bucket, taken in turn."""

    def __init__(self, device_runtime, numel: int):
        self.buffers = [device_runtime.empty(numel, torch.float32) for _ in range(2)]
        self._last_use = [None, None]   # per buffer: the event of the last cast that read it
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def take(self, numel: int, blocks) -> tuple[torch.Tensor, int]:
        """The next buffer (its first ``numel`` elements) and its slot, once the cast that last read it is done
        (the host waits for that event only, booked in ``blocks``: the upload two before this one)."""
        slot, self._next = self._next, 1 - self._next
        if self._last_use[slot] is not None:
            blocks.event(self._last_use[slot], "device-cast staging reuse")
            self._last_use[slot] = None
        return self.buffers[slot][:numel], slot

    def used(self, slot: int, event) -> None:
        self._last_use[slot] = event


HALF_WEIGHTS = (torch.bfloat16, torch.float16)   # weights cast from the fp32 master into a pinned 2-byte stage

LOW_CURRENT, LOW_SPARE, LOW_STALE = "current", "spare", "stale"   # what a bucket's bf16 copy holds


def flat_real(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened as a bucket stores it: a complex tensor as its interleaved (real, imaginary) elements
    (``torch.view_as_real``; torch.optim.AdamW steps complex parameters as these real views)."""
    return (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)


def store_gradients(segment_of, has_grad: list[bool], segments: list[int], grads: list[torch.Tensor],
                    accumulate: bool) -> None:
    """Put each gradient into its flat segment (``segment_of(i)``), on the gradient's own device: a copy, or an
    add when accumulating micro-batches and the segment already holds one; marks the segment as holding one."""
    for i, g in zip(segments, grads):
        dst = segment_of(i)
        if accumulate and has_grad[i]:
            dst.add_(flat_real(g))
        else:
            dst.copy_(flat_real(g))
        has_grad[i] = True


def upload_order(buckets: list) -> list:
    """Buckets in the order the next forward first reads them (``fw_rank``, set by passes/wait_uploads.py),
    then the others in reverse gradient order (the forward order of an eager model), so that the uploads
    on the h2d stream arrive in the order the forward waits for them."""
    ranked = sorted((b for b in buckets if b.fw_rank is not None), key=lambda b: b.fw_rank)
    return ranked + [b for b in reversed(buckets) if b.fw_rank is None]


class HostMasterCopies:
    """The host master's copies of a ``FlatBucket`` (its base class): see the NOTE above."""

    def _init_host_copies(self) -> None:
        # mirror mode: the parameters' flat device buffer (None: the parameters alias ``master``)
        self.weights = self.make_buffer(WEIGHTS_BUFFER) if self.has_buffer(WEIGHTS_BUFFER) else None
        self.dirty = False             # master changed since the last upload
        self.grad_event = None         # CUDA: the D2H copy of the last gradients (the CPU step waits on it)
        self.upload_event = None       # CUDA: the last upload (host buffers it reads are not rewritten before it)
        self._upload_waited = True     # the compute stream was told to wait for upload_event
        self.graph_fetches = False        # a compiled graph's flow fetch waits for the CPU job (read_first_by_fetch)
        self.graph_waits_upload = False   # a compiled forward waits for the upload before its first read of the
        #                                   bucket (passes/wait_uploads.py); else opt.step() makes compute wait
        self.fw_rank = None            # position of the bucket's first read in the compiled forward (upload order)
        self._pending_adds: list[int] = []   # CUDA accumulation: segments staged in _stage_acc, to add to grad
        self._stage_acc = None         # CUDA accumulation: pinned landing for micro-batches 2.., in grad's dtype
        self.upload_staging = None     # UploadStaging: the device casts the uploads (plan's cast_site "device")
        self._stage16 = None           # CUDA bf16 weights: pinned bf16 copy of master, uploaded as is
        # What the bf16 copy the kernel may write (``low_out``: weights on the CPU build, _stage16 on CUDA) holds:
        # the current master cast to bf16, the spare's (a step into the spare wrote it; a commit's swap makes
        # it current), or neither (cast again before it is read).
        self._low_holds = LOW_CURRENT
        self._low_spare_grads = ()   # LOW_SPARE: the segments (has_grad) whose copy holds the spare's values

    def master_crosses(self) -> bool:
        """The host master is read by copies to the device (pinned on CUDA) when the weights are not bf16: their
        uploads and fetches read it. bf16 weights go up and are fetched from the pinned bf16 stage; only a flow
        fetch with an fp32 link dtype (or a stage out of sync) reads their master, a copy from pageable memory
        that CUDA makes synchronous: correct, at the pageable rate. A shared master never crosses. A stationary
        bucket whose plan casts on the device (``cast_site == "device"``) uploads its fp32 master itself."""
        device_cast = self.cast_site == "device" and not self.flow and self.site == "cpu"
        return self.mirror and (self.dtype not in HALF_WEIGHTS or device_cast)

    def async_host_copies(self) -> bool:
        """Host buffers that the runtime's copy streams read or write asynchronously (pinned)."""
        return self.mirror and self.site == "cpu" and self.separate_device

    def low_out(self, into_spare: bool = False) -> torch.Tensor | None:
        """Where a kernel step may write the bf16 copy of the master it computes, in the same pass: the device
        weights themselves on the CPU build (they are host memory) for a stationary bucket; the (pinned) bf16
        stage that is uploaded as is on CUDA, and that a flow bucket's fetches read; None when the weights are
        not bf16 or the bucket is stepped on the device. Only while that copy holds the current master (the
        kernel writes the segments it steps; the others must already be right). A step ``into_spare`` of a
        sharded bucket writes the window's spare only, so it gets none (its commit casts at upload)."""
        if self.weights is None or self.site != "cpu" or self.dtype != torch.bfloat16 or self.device_casts:
            return None
        if self.device_shard is not None:   # device-side ZeRO: the shard is cast into its own stage at upload
            return None
        if into_spare and self.sharded:
            return None
        # The kernel writes the segments with gradients; the others must hold the current master's cast. After a
        # step into the spare they do, and a new step over the same segments (a redo) overwrites all the rest.
        spare_ok = self._low_holds == LOW_SPARE and tuple(self.has_grad) == self._low_spare_grads
        if self._low_holds != LOW_CURRENT and not spare_ok:
            return None
        if self.flow or self.separate_device:
            return self._stage16
        return self.weights

    def kernel_stepped(self, into_spare: bool, wrote_low: bool) -> None:
        """A kernel step ran: in place, the master changed (its bf16 copy with it when ``wrote_low``); into the
        spare, the current master is untouched and the copy, when written, holds the spare's."""
        if into_spare:
            if wrote_low:   # the device-side copy no longer matches the current master: upload before a read
                self._low_holds, self._low_spare_grads = LOW_SPARE, tuple(self.has_grad)
                self.dirty = True
            return
        self.dirty = True
        self._low_holds = LOW_CURRENT if wrote_low else LOW_STALE

    def low_swapped(self) -> None:
        """The spare and the current master traded places (``swap_in_spare``, which first makes them equal on the
        segments without gradients): the bf16 copy that held one now holds the other."""
        if self._low_holds == LOW_CURRENT:
            self._low_holds, self._low_spare_grads = LOW_SPARE, tuple(self.has_grad)
        elif self._low_holds == LOW_SPARE:
            self._low_holds = LOW_CURRENT

    def low_in_sync(self) -> bool:
        """The bf16 copy holds the current master cast to bf16."""
        return self._low_holds == LOW_CURRENT

    def low_stale(self) -> None:
        """The bf16 copy no longer holds a cast of either master (a new stage, a rewritten window)."""
        self._low_holds = LOW_STALE

    def low_synced(self) -> None:
        """The bf16 copy was just cast from the current master."""
        self._low_holds = LOW_CURRENT

    @property
    def device_casts(self) -> bool:
        """The plan put this stationary bucket's cast on the device (``storage.device_cast``): its fp32 master
        crosses and the device casts it into the weights (through ``upload_staging``, which the graph hands over,
        ``use_upload_staging``); else a bf16 copy cast on the host crosses."""
        return self.storage.device_cast and self.device_shard is None

    def use_upload_staging(self, staging: UploadStaging) -> None:
        """The device's fp32 upload staging this bucket's device casts go through (its graph's, shared)."""
        self.upload_staging = staging

    def link_source(self, dtype: torch.dtype) -> torch.Tensor:
        """What a flow fetch in ``dtype`` reads: the bf16 stage when it holds the master cast to bf16 (half the
        bytes cross the link; the cast was done on the host, by the step's kernel or at upload), else the master
        (the copy converts)."""
        if self._stage16 is not None and self.low_in_sync() and dtype == self._stage16.dtype:
            return self._stage16
        return self.master

    def master_changed(self) -> None:
        """Something other than the kernel wrote the master: every copy of it must be made again."""
        self.dirty, self._low_holds = True, LOW_STALE

    def _sync_stage16(self) -> None:
        if self._stage16 is None:
            self._stage16 = self.make_buffer(LOW_STAGE_BUFFER, zeroed=False)
            self._low_holds = LOW_STALE
        if not self.low_in_sync():
            self.before_host_write()
            self._stage16.copy_(self.master)
            self.host_work.add_work(HOST_CAST, copy_bytes(self.numel, 4, self._stage16.element_size()))
            self.low_synced()

    def before_host_write(self) -> None:
        """Before the kernel rewrites master / the bf16 stage: the upload that reads them must be done (CUDA)."""
        if self.upload_event is not None:
            self.host_blocks.event(self.upload_event, "host write after an upload")
            self.upload_event = None

    @ranges.ranged(ranges.UPLOAD, ranges.own_bucket)
    def upload(self) -> None:
        """Make the device weights equal to the master cast to their dtype (round to nearest even), once the
        master is final. CPU build: a plain copy (none when the kernel already wrote the bf16 copy). CUDA: a
        non_blocking copy from pinned memory on the "h2d" stream, after the compute stream passed this bucket's
        last read (its gradient event); ``wait_upload_on_compute`` orders the next forward after it."""
        if self.device_shard is not None:   # device-side ZeRO: this rank's window (publish: the all-gather)
            self.device_shard.refresh_window(self)
            return
        self.dirty = False
        if self.flow and self.dtype in HALF_WEIGHTS:   # no upload; the 2-byte stage the next fetch reads
            self._sync_stage16()
            return
        if not self.mirror or self.weights is None or self.flow:
            return
        if self.site == "device":          # a device-side cast on the current stream
            self.weights.copy_(self.master)
            return
        if self.device_casts:
            self._upload_cast_on_device()
            return
        self.traffic.add_copy("h2d", WEIGHT_UPLOAD, self.weights)   # bf16 cast on the host, or fp32 weights
        rt = self.runtime
        if not self.separate_device:
            if self.dtype != torch.bfloat16 or not self.low_in_sync():
                self.weights.copy_(self.master)   # the CPU build's "device" is host memory: host work
                self.host_work.add_work(UPLOAD_COPY if self.dtype == torch.float32 else HOST_CAST,
                                        copy_bytes(self.numel, 4, self.weights.element_size()))
            self.low_synced()
            return
        src = self.master
        if self.dtype in HALF_WEIGHTS:   # cast on the host: half the bytes cross the link, as they land
            self._sync_stage16()
            src = self._stage16
        h2d = self._h2d_after_grads(rt)
        self.upload_issued(rt.copy_async(self.weights, src, h2d), compute_waits=False)

    def _h2d_after_grads(self, rt):
        h2d = rt.stream("h2d")
        if self.grad_event is not None:    # the compute stream is past the last read of these weights
            h2d.wait_event(self.grad_event)
        return h2d

    def _upload_cast_on_device(self) -> None:
        """The plan's cast_site "device": the fp32 master crosses into a device staging buffer and the device
        casts it into the weights, both on the "h2d" stream. The staging buffer is reused two uploads later, once
        the cast that read it is done (``UploadStaging.take``). CPU build: the same two copies, in host memory."""
        if self.upload_staging is None:
            raise RuntimeError(f"socompile: bucket {self.index} casts its uploads on the device but was given no "
                               f"upload staging (use_upload_staging); this is a bug")
        staging, slot = self.upload_staging.take(self.numel, self.host_blocks)
        self.traffic.add_copy("h2d", WEIGHT_UPLOAD, staging)
        rt = self.runtime
        if not self.separate_device:
            staging.copy_(self.master)
            self.weights.copy_(staging)
            return
        h2d = self._h2d_after_grads(rt)
        rt.copy_async(staging, self.master, h2d)
        self.upload_issued(rt.copy_async(self.weights, staging, h2d), compute_waits=False)   # after the copy
        self.upload_staging.used(slot, self.upload_event)

    def read_first_by_fetch(self) -> None:
        """A compiled graph's flow fetch waits for this bucket's CPU job on the host before it reads the master
        or its bf16 stage (runtime/offload.py), as ``wait_upload`` does for a stationary bucket."""
        self.graph_fetches = True

    def read_first_by_graph(self, rank: int) -> None:
        """A compiled forward waits for this bucket's upload before its first read (passes/wait_uploads.py), the
        ``rank``-th bucket it reads: uploads are issued in that order (``upload_order``)."""
        self.graph_waits_upload, self.fw_rank = True, rank

    def gradients_landing(self, event) -> None:
        """A copy into the host ``grad`` was issued as ``event`` (device-side ZeRO's reduced shard);
        ``wait_grads`` waits for it."""
        self.grad_event = event

    def weights_current(self) -> None:
        """The device weights hold the current master (an upload of it was issued)."""
        self.dirty = False

    def upload_issued(self, event, compute_waits: bool) -> None:
        """An upload of this bucket's weights (or its shard) was issued as ``event``; ``compute_waits``: the
        compute stream was already told to wait for it."""
        self.upload_event, self._upload_waited = event, compute_waits

    @property
    def upload_pending(self) -> bool:
        """An upload was issued that the compute stream has not been told to wait for yet (CUDA only)."""
        return self.upload_event is not None and not self._upload_waited

    def wait_upload_on_compute(self) -> bool:
        """The compute stream waits (no host block) for this bucket's upload before it reads the weights; once
        per upload. Device-side ZeRO: for the weights' all-gather (distributed/zero_gather.py). True when a wait
        was queued (or done) now."""
        gathered = self.device_shard is not None and self.device_shard.wait_gathered()
        if self.upload_event is not None and not self._upload_waited:
            self.runtime.wait_on_compute(self.upload_event)
            self._upload_waited = True
            return True
        return gathered

    def free_weights(self) -> None:
        """A flow bucket's device weights hold no bytes between uses (the storage is resized to 0; the views'
        sizes and strides stay, so guards on them still match; reading one is an invalid access)."""
        if self.weights is not None and self.flow:
            self.weights.untyped_storage().resize_(0)

    def _holds_no_weights(self) -> bool:
        return self.weights is not None and self.flow and not self.weights.untyped_storage().nbytes()

    def _fill_weights(self) -> None:
        self.weights.untyped_storage().resize_(self.numel * self.weights.element_size())
        if self.device_shard is not None:   # device-side ZeRO: this rank holds a shard; the ranks' are gathered
            self.device_shard.gather_weights(self)
            return
        self.weights.copy_(self.master)

    def keep_weights(self) -> None:
        """Fill a flow bucket's device weights from the master for good: the optimizer hands its parameters
        back to the model (a newer optimizer took them over), so they must hold their values from now on."""
        if self._holds_no_weights():
            self._fill_weights()

    @contextlib.contextmanager
    def materialized(self, pull: bool = False):
        """A flow bucket's device weights, filled from the master, for as long as the block runs (checkpoints,
        eager evaluation); with ``pull``, values written into the parameters meanwhile go back into the master."""
        if not self._holds_no_weights():
            yield
            if pull:
                self.pull_from_weights()
            return
        try:
            self._fill_weights()
            yield
            if pull:
                self.pull_from_weights()
        finally:
            self.free_weights()

    def pull_from_weights(self, segments: list[int] | None = None) -> None:
        """The master from the parameters (after something wrote the weights directly, e.g. a model
        ``load_state_dict``): exact for fp32 weights; bf16 weights give their bf16 values. ``segments``: only
        those parameters (default: all)."""
        if self.weights is None or not self.weights.untyped_storage().nbytes():
            return   # parameters alias the master, or flow weights that hold nothing (see ``materialized``)
        self.wait_upload_on_compute()   # CUDA: an upload still writing the weights is ordered before the read
        self.before_host_write()
        if self.device_shard is not None:   # device-side ZeRO: the parts in this rank's window only
            for i in range(len(self.params)) if segments is None else segments:
                self.load_segment_window(i, self.view(self.weights, i))
            return
        for i in range(len(self.params)) if segments is None else segments:
            seg = self.segment(i)
            self.master[seg].copy_(self.weights[seg])
        self.master_changed()

    def load_segment(self, i: int, value: torch.Tensor) -> None:
        """Parameter i's master from ``value`` (its shape; any dtype and device), e.g. a flow parameter loaded
        by ``model.load_state_dict``; the copies of the master are made again (``master_changed``)."""
        self.before_host_write()
        if self.device_shard is not None:   # device-side ZeRO: the part of the parameter in this rank's window
            self.load_segment_window(i, value)
            return
        self.view(self.master, i).copy_(value.detach().reshape(self.params[i].shape))
        self.master_changed()

    def load_segment_window(self, i: int, value: torch.Tensor) -> None:
        lo, hi = self.window
        start, end = max(self.offsets[i], lo), min(self.offsets[i] + self.sizes[i], hi)
        if end > start:
            flat = flat_real(value.detach().reshape(self.params[i].shape))
            self.master[self.host(start, end)].copy_(flat[start - self.offsets[i]:end - self.offsets[i]])
        self.master_changed()

    def receive(self, i: int, grad: torch.Tensor, accumulate: bool) -> None:
        """Store a gradient for parameter i (copy, or add when accumulating micro-batches)."""
        self.receive_many([i], [grad], accumulate)

    @ranges.ranged(ranges.GRAD_COPY, ranges.own_bucket)
    def receive_many(self, segments: list[int], grads: list[torch.Tensor], accumulate: bool) -> None:
        """Store gradients (copy, or add when accumulating and the segment already has one). A gradient on
        another device than ``grad`` (CUDA -> pinned host) is copied asynchronously on the runtime's "d2h"
        stream after the compute stream's work so far; ``wait_grads`` waits for that copy's event (and adds
        staged micro-batches). Anything else is a plain copy, converting the dtype (bf16 -> fp32)."""
        if self.device_shard is not None:   # device-side ZeRO: gathered on the device, reduced there
            self.device_shard.receive(self, segments, grads, accumulate)
            return
        remote = [g.device for g in grads if g.device != self.grad.device]
        if remote and not self.async_host_copies():
            raise RuntimeError(f"socompile: bucket {self.index} got a gradient on {remote[0]} but has no CUDA "
                               f"runtime to copy it to the host; this is a bug")
        if self.async_host_copies():
            self.wait_grads()                  # a staged micro-batch is added before its stage is reused
            pairs = []
            for i, g in zip(segments, grads):
                seg = self.segment(i)
                add = accumulate and self.has_grad[i]
                if add:
                    if self._stage_acc is None:
                        self._stage_acc = self.make_buffer(ACCUMULATION_BUFFER, zeroed=False)
                    self._pending_adds.append(i)
                pairs.append(((self._stage_acc if add else self.grad)[seg], flat_real(g)))
                self.has_grad[i] = True
            self._count_gradients(pairs)
            self.grad_event = self.runtime.copy_many_async(pairs, self.runtime.stream("d2h"))
            return
        if self.site == "cpu":   # the CPU build: the graph's gradients are host tensors, copied or added here
            for i, g in zip(segments, grads):
                self.host_work.add_work(*((ACCUMULATION_ADD, add_bytes(self.sizes[i], self.grad.element_size()))
                                          if accumulate and self.has_grad[i] else
                                          (GRADIENT_COPY, copy_bytes(self.sizes[i], g.element_size(),
                                                                     self.grad.element_size()))))
        store_gradients(lambda i: self.grad[self.segment(i)], self.has_grad, segments, grads, accumulate)
        if self.mirror and self.site == "cpu":   # the CPU build's host copy stands for the link the gradients cross
            self._count_gradients([(self.grad[self.segment(i)], None) for i in segments])

    def _count_gradients(self, pairs) -> None:
        """Book the gradient bytes that cross: the segments' elements (the padding between them is not copied),
        in the landing buffer's dtype."""
        numel = sum(dst.numel() for dst, _ in pairs)
        self.traffic.add("d2h", self.grad.dtype, GRADIENTS, numel * self.grad.element_size())

    def wait_grads_on_compute(self) -> None:
        """The compute stream waits (no host block on CUDA) for the gradient copy, before the graph reuses the
        gradients' memory (``socompile::grads_copied``)."""
        if self.grad_event is not None and self.async_host_copies():
            self.runtime.wait_on_compute(self.grad_event)

    def wait_grads(self) -> None:
        """Block this host thread until the bucket's gradient copy (CUDA event) is done; add staged
        micro-batches. A no-op on the CPU build and for device-stepped buckets."""
        if self.grad_event is None:
            return
        self.host_blocks.event(self.grad_event, "gradient copy to the host")
        for i in self._pending_adds:
            seg = self.segment(i)
            self.grad[seg].add_(self._stage_acc[seg])
            self.host_work.add_work(ACCUMULATION_ADD, add_bytes(self.sizes[i], self.grad.element_size()))
        self._pending_adds.clear()
