"""GraphClaim: the buckets one compiled backward graph feeds, and the handle the graph's ops reach them by
(graphs can only hold plain values; see runtime/handles.py)."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from ..runtime import handles
from ..runtime.flat_bucket import FlatBucket

if TYPE_CHECKING:
    from .adamw import AdamW


class GraphClaim:
    """The buckets one compiled backward graph feeds, addressed by a handle from inside the graph."""

    def __init__(self, optimizer: "AdamW", buckets: list[FlatBucket], early_step: list[bool]):
        self._optimizer = weakref.ref(optimizer)
        self.buckets = buckets
        self.early_step = early_step   # per bucket: may its step start as soon as its gradients arrive?
        self.handle = handles.register(self)

    def on_grads(self, bucket: int, segments: list[int], grads: list[torch.Tensor]) -> None:
        opt = self._optimizer()
        if opt is None:
            raise RuntimeError("the socompile optimizer of this compiled model was deleted")
        opt._on_grads(self.buckets[bucket], segments, grads, may_speculate=self.early_step[bucket])

    def wait_upload(self, bucket: int) -> None:
        """``socompile::wait_upload``: the forward is about to read this bucket's weights first; the compute
        stream waits for their upload (CUDA; nothing to wait for on the CPU build, where uploads are copies)."""
        flat = self.buckets[bucket]
        if flat.wait_upload_on_compute():
            opt = self._optimizer()
            if opt is not None:
                opt.events.record("fw_wait_upload", flat.index)
