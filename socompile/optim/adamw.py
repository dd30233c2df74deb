"""socompile.AdamW: a drop-in ``torch.optim.Optimizer`` whose step runs per gradient bucket on the CPU.

Semantics are torch.optim.AdamW's (and its state_dict layout), plus ``max_grad_norm``: clipping must be known
while steps are speculated, so it is an optimizer argument rather than a separate ``clip_grad_norm_`` call.

Compiled with ``backend="superoffload"``, the backward graph hands each bucket's gradients to this optimizer
as soon as they exist; a bucket whose step needs no validation is stepped right then by the CPU worker while
backward goes on. ``step()`` waits for those, steps the rest, and commits. Used eagerly, ``step()`` takes the
gradients from ``.grad`` and steps every bucket through the same kernel.
"""
from __future__ import annotations

import math
import weakref
from typing import Iterable

import torch
from torch import nn

from ..options import parse_bytes
from ..plan.bucketize import bucketize
from ..runtime import handles
from ..runtime.cpu_adam import grad_sumsq, step_bucket
from ..runtime.events import EventLog
from ..runtime.flat_bucket import FlatBucket
from ..runtime.worker import CPUWorker


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


class AdamW(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, max_grad_norm: float | None = None,
                 bucket_size: int | str = "64MB", grad_accumulation_steps: int = 1, decoupled: bool = True):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        if grad_accumulation_steps < 1:
            raise ValueError(f"grad_accumulation_steps must be >= 1, got {grad_accumulation_steps}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, decoupled=decoupled)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.bucket_size = parse_bytes(bucket_size, "bucket_size")
        self.grad_accumulation_steps = grad_accumulation_steps
        self.events = EventLog()
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self._worker: CPUWorker | None = None
        self._claims: dict[frozenset[int], GraphClaim] = {}
        self._slot: dict[int, tuple[FlatBucket, int]] = {}
        self._group_index: dict[int, int] = {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                owner = getattr(p, "_socompile_owner", None)
                if owner is not None and owner() is not None and owner() is not self:
                    raise ValueError("a parameter is already owned by another socompile optimizer; each "
                                     "parameter may belong to one socompile optimizer only")
                p._socompile_owner = weakref.ref(self)
                self._group_index[id(p)] = gi
        self._pool: list[FlatBucket] = []
        self._rebuild_pool()

    # ----------------------------------------------------------------- layout
    def _all_params(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def buckets(self) -> list[FlatBucket]:
        claimed = [b for claim in self._claims.values() for b in claim.buckets]
        return claimed + self._pool

    def _rebuild_pool(self) -> None:
        """Bucket every trainable parameter no compiled graph has claimed, in reverse registration order
        (the usual order of gradients in backward)."""
        claimed = {id(p) for claim in self._claims.values() for b in claim.buckets for p in b.params}
        free = [p for p in reversed(self._all_params())
                if id(p) not in claimed and (p.requires_grad or p.grad is not None)]
        by_id = {id(p): p for p in free}
        groups = bucketize([(str(id(p)), p.numel()) for p in free], self.bucket_size)
        # Pool buckets get negative indices so events never confuse them with a graph's planned buckets.
        self._pool = self._make_buckets([[by_id[int(k)] for k in names] for names in groups],
                                        indices=[-1 - k for k in range(len(groups))])

    def _make_buckets(self, param_lists: list[list[nn.Parameter]], indices: list[int]) -> list[FlatBucket]:
        made = []
        for index, params in zip(indices, param_lists):
            bucket = FlatBucket(index, params)
            bucket.adopt(self._slot)
            bucket.group_of = [self._group_index[id(p)] for p in params]
            made.append(bucket)
        for bucket in made:
            for i, p in enumerate(bucket.params):
                self._slot[id(p)] = (bucket, i)
                if p in self.state:
                    self.state[p]["exp_avg"] = bucket.view(bucket.exp_avg, i)
                    self.state[p]["exp_avg_sq"] = bucket.view(bucket.exp_avg_sq, i)
        return made

    def claim(self, param_lists: list[list[nn.Parameter]], early_step: list[bool] | None = None) -> GraphClaim:
        """Lay out the buckets a compiled backward graph feeds (called by the backend at compile time).
        ``early_step[i]``: bucket i may be stepped by the CPU worker as its gradients arrive; otherwise (a
        device-resident bucket, or speculation turned off) it is stepped in ``step()`` after validation. A recompile of the same graph (same
        parameters) gets its existing claim back."""
        self._wait_pending()
        key = frozenset(id(p) for params in param_lists for p in params)
        if key in self._claims:
            return self._claims[key]
        for other in self._claims:
            if key & other:
                raise RuntimeError(
                    "a parameter is used by two different compiled graphs (a graph break inside the model?). "
                    "socompile steps each parameter from one backward graph: compile with fullgraph=True to "
                    "find the break, or move the shared parameter's use into one graph.")
        for p in (p for params in param_lists for p in params):
            if id(p) not in self._group_index:
                raise ValueError("the compiled graph's parameter is not in this optimizer")
        claim = GraphClaim(self, self._make_buckets(param_lists, indices=list(range(len(param_lists)))),
                           early_step=list(early_step) if early_step is not None else [True] * len(param_lists))
        self._claims[key] = claim
        self._rebuild_pool()
        return claim

    # ------------------------------------------------------------- backward
    def _on_grads(self, bucket: FlatBucket, segments: list[int], grads: list[torch.Tensor],
                  may_speculate: bool = True) -> None:
        """Called from inside the compiled backward when all of ``bucket``'s gradients exist."""
        if bucket.arrivals >= self.grad_accumulation_steps:
            raise RuntimeError(f"backward ran {bucket.arrivals + 1} times before opt.step(), but the socompile "
                               f"optimizer expects {self.grad_accumulation_steps}. Call opt.step() after each "
                               "backward, or set grad_accumulation_steps=N on socompile.AdamW to accumulate N "
                               "backward passes per step.")
        self.events.record("grads_ready", bucket.index)
        for i, grad in zip(segments, grads):
            p = bucket.params[i]
            bucket.receive(i, grad, accumulate=p.grad is not None)
            p.grad = bucket.view(bucket.grad, i)
        bucket.arrivals += 1
        if may_speculate and self._may_speculate() and bucket.arrivals >= self.grad_accumulation_steps:
            bucket.pending = self._get_worker().submit(lambda: self._step_logged(bucket, 1.0))

    def _may_speculate(self) -> bool:
        # Without validation (no clipping) the step at gradient arrival is final: speculation is exact.
        # With max_grad_norm, steps wait for the global norm (speculation with rollback is issue 6).
        return self.max_grad_norm is None

    def _step_logged(self, bucket: FlatBucket, grad_scale: float) -> None:
        self.events.record("step_start", bucket.index)
        step_bucket(bucket, self.param_groups, bucket.group_of, grad_scale)
        self.events.record("step_end", bucket.index)

    def _get_worker(self) -> CPUWorker:
        if self._worker is None:
            self._worker = CPUWorker()
        return self._worker

    def _wait_pending(self) -> None:
        for bucket in self.buckets:
            if bucket.pending is not None:
                future, bucket.pending = bucket.pending, None
                future.result()  # re-raises a kernel error here, in the training loop

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._wait_pending()
        self._adopt_new_trainables()
        buckets = self.buckets
        for bucket in buckets:
            if not bucket.stepped:
                bucket.gather_eager_grads()
        scale = self._validate(buckets)
        if scale is not None:
            for bucket in buckets:
                if not bucket.stepped:
                    self._step_logged(bucket, scale)
            self._commit(buckets)
        for bucket in buckets:
            bucket.arrivals, bucket.stepped = 0, False
        return loss

    def _validate(self, buckets: list[FlatBucket]) -> float | None:
        """None: skip the step (non-finite norm). Else the gradient scale (clip coefficient, or 1)."""
        self.last_step_skipped = False
        if self.max_grad_norm is None:
            return 1.0
        total, nonfinite = 0.0, False
        for bucket in buckets:
            s, bad = grad_sumsq(bucket)
            total, nonfinite = total + s, nonfinite or bad
        norm = math.sqrt(total) if not nonfinite else float("nan")
        self.last_grad_norm = norm
        self.events.record("validate")
        if not math.isfinite(norm):
            self.last_step_skipped = True
            return None
        # Same coefficient as torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), clamped to 1.
        return min(1.0, self.max_grad_norm / (norm + 1e-6))

    def _commit(self, buckets: list[FlatBucket]) -> None:
        for bucket in buckets:
            for i, p in enumerate(bucket.params):
                if not bucket.has_grad[i]:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = bucket.view(bucket.exp_avg, i)
                    state["exp_avg_sq"] = bucket.view(bucket.exp_avg_sq, i)
                state["step"].fill_(float(bucket.steps[i]))
        self.events.record("commit")

    def _adopt_new_trainables(self) -> None:
        if any(id(p) not in self._slot and p.grad is not None for p in self._all_params()):
            self._rebuild_pool()

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._wait_pending()
        for bucket in self.buckets:
            for p in bucket.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
            bucket.has_grad = [False] * len(bucket.params)
        for p in self._all_params():
            if id(p) not in self._slot and p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self):
        self._wait_pending()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._wait_pending()
        super().load_state_dict(state_dict)
        # torch's loader replaced our views with fresh tensors: copy them into the buckets, re-alias.
        for p, state in self.state.items():
            bucket, i = self._slot[id(p)]
            for key, buffer in (("exp_avg", bucket.exp_avg), ("exp_avg_sq", bucket.exp_avg_sq)):
                if key in state:
                    bucket.view(buffer, i).copy_(state[key])
                    state[key] = bucket.view(buffer, i)
            if "step" in state:
                bucket.steps[i] = int(state["step"].item())

    def __del__(self):
        if getattr(self, "_worker", None) is not None:
            self._worker.shutdown()
