"""GraphClaim: the buckets one compiled backward graph feeds, and the handle the graph's ops reach them by
(graphs can only hold plain values; see runtime/handles.py).

NOTE: active and stale claims. Several compiled graphs may use the same parameters: Dynamo compiles the frame
again when a parameter's requires_grad changes (freezing, unfreezing, a new param group), and keeps one graph
per value of a model attribute it guards on, running them alternately. A parameter's optimizer state lives in
one bucket at a time, so only claims whose buckets hold their parameters are *active*: the newest claim takes
overlapping parameters over (its buckets adopt their moments, master and step counts), and the claims it took
them from become stale. Running a stale claim's graph activates it again first (backend: ``activating``).
Why re-activate rather than deliver a stale graph's gradients like eager ones: the plan of a graph also
shapes its forward (weight flow fetches weights from the claim's own buckets) and its buckets (sites,
rollback modes, early steps); only the claim's own layout keeps those promises. The price is one copy of the
shared state each time the graph in use changes.

Two graphs that both produce a parameter's gradient in one backward (a parameter used on both sides of a
graph break) cannot be served this way: the sibling pieces of a split frame are refused at claim time, and
any other case when the stale graph's gradients arrive.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..runtime import handles
from ..runtime.flat_bucket import FlatBucket

if TYPE_CHECKING:
    from .adamw import AdamW

BOTH_SIDES = ("a parameter is used by two different compiled graphs (a graph break inside the model?) whose "
              "backward passes both produce its gradient. socompile steps each parameter from one backward "
              "graph: compile with fullgraph=True to find the break, or move the shared parameter's use into "
              "one graph.")


@dataclasses.dataclass(frozen=True)
class ClaimLayout:
    """What the plan asks of the optimizer's buckets for one graph (see ``AdamW.claim``)."""

    param_lists: tuple[tuple[nn.Parameter, ...], ...]
    early_step: tuple[bool, ...]
    rollback: tuple[str, ...] | None
    sites: tuple[str, ...] | None
    flow: tuple[bool, ...] | None
    link_dtypes: tuple[str, ...] | None = None   # the plan's BucketPlan.link_dtype: the gradient landing dtype
    cast_sites: tuple[str, ...] | None = None    # the plan's BucketPlan.cast_site: where uploads are cast

    @classmethod
    def of(cls, param_lists, early_step=None, rollback=None, sites=None, weight_modes=None, link_dtypes=None,
           cast_sites=None) -> "ClaimLayout":
        return cls(tuple(tuple(ps) for ps in param_lists),
                   tuple(early_step) if early_step is not None else (True,) * len(param_lists),
                   tuple(rollback) if rollback else None, tuple(sites) if sites else None,
                   tuple(m == "flow" for m in weight_modes) if weight_modes else None,
                   tuple(link_dtypes) if link_dtypes else None, tuple(cast_sites) if cast_sites else None)

    @property
    def key(self) -> frozenset[int]:
        return frozenset(id(p) for params in self.param_lists for p in params)

    def bucket_args(self) -> dict:
        """``BucketStore.make``'s arguments for this layout (optim/bucket_layout.py)."""
        return dict(param_lists=[list(ps) for ps in self.param_lists], indices=list(range(len(self.param_lists))),
                    sites=list(self.sites) if self.sites else None, flow=list(self.flow) if self.flow else None,
                    link_dtypes=list(self.link_dtypes) if self.link_dtypes else None,
                    cast_sites=list(self.cast_sites) if self.cast_sites else None)


@dataclasses.dataclass(frozen=True)
class GraphOrigin:
    """Which Dynamo frame compiled the graph, and whether that frame is split by a graph break (the graph is
    one of its pieces). None: not known (a claim made outside the backend, or an older torch)."""

    frame: int | None = None
    piece: bool = False

    def sibling_of(self, other: "GraphOrigin") -> bool:
        """Two pieces of a graph-broken region (not two compiles of one frame): both run in one iteration."""
        return self.piece and other.piece and (self.frame is None or self.frame != other.frame)


class GraphClaim:
    """The buckets one compiled backward graph feeds, addressed by a handle from inside the graph."""

    def __init__(self, optimizer: "AdamW", layout: ClaimLayout, origin: GraphOrigin):
        self._optimizer = weakref.ref(optimizer)
        self.layout = layout
        self.origin = origin
        self.early_step = list(layout.early_step)   # per bucket: may its step start as its gradients arrive?
        self.buckets: list[FlatBucket] = []   # refilled in place on activation: offload runtimes hold this list
        self.active = False
        self.handle = handles.register(self)

    def laid_out(self) -> None:
        """The optimizer laid this claim's buckets out: the graph's ops reach them from now on."""
        self.active = True

    def activate(self) -> None:
        """Before this graph's forward runs: make its buckets hold its parameters' state again if another
        graph took them over (see the module's NOTE)."""
        opt = self._optimizer()
        if opt is None:
            return
        opt.events.record("forward")
        if not self.active:
            opt.activate_claim(self)

    def on_grads(self, bucket: int, segments: list[int], grads: list[torch.Tensor]) -> None:
        opt = self._optimizer()
        if opt is None:
            raise RuntimeError("the socompile optimizer of this compiled model was deleted")
        if not self.active:   # another graph's forward took the parameters over after this graph's forward
            raise RuntimeError(BOTH_SIDES + " (Seen at backward: another compiled graph that uses the same "
                               "parameters ran its forward between this graph's forward and its backward.)")
        opt.receive_gradients(self.buckets[bucket], segments, grads, may_speculate=self.early_step[bucket])

    def grads_copied(self, bucket: int) -> None:
        """``socompile::grads_copied``: the graph may reuse this bucket's gradient buffers from here on; the
        compute stream waits for their copy to the host first (CUDA)."""
        self.buckets[bucket].wait_grads_on_compute()

    def wait_upload(self, bucket: int) -> None:
        """``socompile::wait_upload``: the forward is about to read this bucket's weights first. The host waits
        for this bucket's CPU job, if ``opt.step()`` returned before it ended (that job queues the upload),
        then the compute stream waits for the upload (CUDA: a queued wait; the CPU build's upload is a copy)."""
        flat = self.buckets[bucket]
        opt = self._optimizer()
        if opt is not None:
            opt.wait_bucket(flat)
        if flat.wait_upload_on_compute() and opt is not None:
            opt.events.record("fw_wait_upload", flat.index)


class Claims:
    """Every claim of one optimizer, by parameter set, active or stale."""

    def __init__(self):
        self._by_key: dict[frozenset[int], GraphClaim] = {}

    def active(self) -> list[GraphClaim]:
        return [c for c in self._by_key.values() if c.active]

    def get_or_add(self, optimizer: "AdamW", layout: ClaimLayout, origin: GraphOrigin) -> GraphClaim:
        """The claim of these parameters (a recompile of the same graph gets it back), or a new one."""
        claim = self._by_key.get(layout.key)
        if claim is None:
            if any(layout.key & key and origin.sibling_of(c.origin) for key, c in self._by_key.items()):
                raise RuntimeError(BOTH_SIDES)
            claim = self._by_key[layout.key] = GraphClaim(optimizer, layout, origin)
        return claim

    def take_over(self, claim: GraphClaim) -> None:
        """Make the active claims that share parameters with ``claim`` stale (its buckets will hold them)."""
        taken = [c for key, c in self._by_key.items() if c.active and key & claim.layout.key]
        for other in taken:
            if any(b.stepped or b.speculated for b in other.buckets):
                raise RuntimeError("socompile: a compiled graph ran its forward between backward and opt.step() "
                                   "while another graph of the same parameters has steps in flight (a recompile, "
                                   "or a branch switched by a model attribute). Call opt.step() or "
                                   "opt.zero_grad() first, or run such forwards under torch.no_grad().")
            other.active = False
