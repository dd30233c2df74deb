"""The weight all-gather of device-sharded buckets (runtime/sharded_bucket.py), overlapped with the next forward.

``opt.step()`` uploads each bucket's updated master shard and *issues* the all-gather of its device weights
(async: ``zero_device.publish``), in the order the next forward first reads the buckets
(``host_master.upload_order``: ``fw_rank``, set by passes/wait_uploads.py). Nothing waits there. Each bucket's
all-gather is waited for once, by the first thing that reads its weights (``DeviceShard.wait_gathered``, called
from ``FlatBucket.wait_upload_on_compute``):

    compiled forward        socompile::wait_upload, right before the bucket's first read (passes/wait_uploads.py)
    eager forward           a forward pre-hook on the modules owning the parameters, for their buckets only
                            (``EagerReadWaits``)
    state_dict, checkpoints the model's state_dict hook, ``opt.materialized_weights`` / ``opt.wait_uploads``
    step / backward         the next upload or reduce-scatter into the shard buffer (the all-gather reads it)
    re-layout, teardown     ``ZeroSharding.unshard_state``, ``DeviceShard.close``, ``AdamW.__del__`` / hand-over
    buckets no compiled forward waits for (``graph_waits_upload`` False): at the end of ``step()`` (``upload_buckets``)

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
    """Forward pre-hook of one module owning parameters of a device-sharded optimizer: an eager call waits for the
    all-gathers still in flight of the buckets that hold the module's parameters (an eager read does not need the
    overlap), and no others: per call it looks at its own buckets only, not at every bucket of the optimizer.
    Its parameters are the module's and its submodules' (a module may read a child's weights without calling it,
    as ``nn.MultiheadAttention`` reads ``out_proj.weight``), tied ones included: a weight two modules share
    (tok_emb and lm_head) is in both lists, so neither module's first read skips its wait. Which buckets hold
    them changes when the optimizer lays its buckets out again (a compiled graph claims them): ``EagerReadWaits``
    then indexes them anew. Inside a compile it does nothing: the compiled forward waits per bucket
    (socompile::wait_upload), and Dynamo traces this hook away. Holds the optimizer and the buckets weakly; a
    pickled copy does nothing (its parameters are not the optimizer's)."""

    def __init__(self, optimizer, params):
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None
        self._param_ids = tuple(dict.fromkeys(id(p) for p in params))   # in the module's order, each once
        self._buckets: list[weakref.ref] = []

    def index(self, slot: dict) -> None:
        """The buckets holding this module's parameters, from the optimizer's parameter -> (bucket, segment)
        index ``slot`` (each bucket once; parameters the optimizer does not bucket hold no all-gather)."""
        held = {id(slot[pid][0]): slot[pid][0] for pid in self._param_ids if pid in slot}
        self._buckets = [weakref.ref(bucket) for bucket in held.values()]

    def __call__(self, module, args):
        if torch.compiler.is_compiling():
            return None
        if self._optimizer is None or self._optimizer() is None:
            return None
        for ref in self._buckets:
            bucket = ref()
            if bucket is not None and bucket.device_shard is not None and bucket.device_shard.gather is not None:
                bucket.wait_upload_on_compute()
        return None

    def __reduce__(self):
        return (_WaitBeforeEagerForward, (None, ()))


class EagerReadWaits:
    """The eager-forward waits of one device-sharded optimizer: a ``_WaitBeforeEagerForward`` on each module
    owning its parameters, and the index from each hook to its buckets, built now and again each time the
    optimizer lays buckets out (``ZeroSharding.laid_out``, from optim/bucket_layout.py)."""

    def __init__(self, optimizer):
        from ..optim.module_state import _owning_modules
        self._hooks, self.handles = [], []
        for module in _owning_modules(optimizer.all_params()):
            hook = _WaitBeforeEagerForward(optimizer, module.parameters())
            self._hooks.append(hook)
            self.handles.append(module.register_forward_pre_hook(hook))
        self.index(optimizer.param_slots)

    def index(self, slot: dict) -> None:
        for hook in self._hooks:
            hook.index(slot)
