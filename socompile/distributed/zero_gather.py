"""The weight all-gather of device-sharded buckets (runtime/sharded_bucket.py), overlapped with the next forward.

``opt.step()`` uploads each bucket's updated master shard and *issues* the all-gather of its device weights
(async: ``zero_device.publish``), in the order the next forward first reads the buckets
(``host_master.upload_order``: ``fw_rank``, set by passes/wait_uploads.py). Nothing waits there. Each bucket's
all-gather is waited for once, by the first thing that reads its weights (``DeviceShard.wait_gathered``, called
from ``FlatBucket.wait_upload_on_compute``):

    compiled forward        socompile::wait_upload, right before the bucket's first read (passes/wait_uploads.py)
    eager forward           a forward pre-hook on the modules owning the parameters (``wait_before_eager_reads``)
    state_dict, checkpoints the model's state_dict hook, ``opt.materialized_weights`` / ``opt.wait_uploads``
    step / backward         the next upload or reduce-scatter into the shard buffer (the all-gather reads it)
    re-layout, teardown     ``ZeroSharding.unshard_state``, ``DeviceShard.close``, ``AdamW.__del__`` / hand-over
    buckets no compiled forward waits for (``graph_waits_upload`` False): at the end of ``step()`` (``_upload``)

What a wait costs: with NCCL ``work.wait()`` makes the current (compute) stream wait for the collective, no host
block, so the forward's first layers run while later buckets' weights are still being gathered; with gloo it
blocks the calling thread until that bucket's all-gather is done (the later ones go on in gloo's threads).

NOTE: a forward compiled by another backend (no socompile::wait_upload in it) is not covered: its graph reads
the parameters without asking. Call ``opt.wait_uploads()`` before it, as for any read outside the training graph
that bypasses the module (a parameter tensor held from before).
"""
from __future__ import annotations

import weakref

import torch

from .faults import guard


class PendingGather:
    """An all-gather of one bucket's device weights in flight; ``wait`` once, from the training thread."""

    def __init__(self, work, bucket_index: int, group):
        self.work, self.bucket_index, self.group = work, bucket_index, group

    def wait(self) -> None:
        with guard(f"all-gather of bucket {self.bucket_index} (device, wait)", self.group):
            self.work.wait()


class _WaitBeforeEagerForward:
    """Forward pre-hook of a module owning parameters of a device-sharded optimizer: an eager call waits for
    every all-gather still in flight (an eager read does not need the overlap). Inside a compile it does nothing:
    the compiled forward waits per bucket (socompile::wait_upload), and Dynamo traces this hook away. Holds the
    optimizer weakly; a pickled copy does nothing (its parameters are not the optimizer's)."""

    def __init__(self, optimizer):
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None

    def __call__(self, module, args):
        if torch.compiler.is_compiling():
            return None
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is not None:
            for bucket in optimizer.buckets:
                if bucket.device_shard is not None and bucket.device_shard.gather is not None:
                    bucket.wait_upload_on_compute()
        return None

    def __reduce__(self):
        return (_WaitBeforeEagerForward, (None,))


def wait_before_eager_reads(optimizer) -> list:
    """Register ``_WaitBeforeEagerForward`` on the modules owning the optimizer's parameters; returns the handles."""
    from ..optim.module_state import _owning_modules
    hook = _WaitBeforeEagerForward(optimizer)
    return [module.register_forward_pre_hook(hook) for module in _owning_modules(optimizer._all_params())]
