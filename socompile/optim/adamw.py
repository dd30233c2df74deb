"""socompile.AdamW: a drop-in ``torch.optim.Optimizer`` whose step runs per gradient bucket on the CPU.

Semantics are torch.optim.AdamW's (and its state_dict layout), plus ``max_grad_norm``: clipping known while
steps are speculated, so that backward's bucket steps stand. A script's own ``clip_grad_norm_`` (or any other
change to the gradients between ``backward()`` and ``step()``) is honoured too, at the price of stepping the
changed buckets again in ``step()`` (optim/validation.py ``StepValidation.undo_for_script_gradients``,
optim/script_clip.py).

Compiled with ``backend="superoffload"``, the backward graph hands each bucket's gradients to this optimizer
as soon as they exist, and the CPU worker steps the bucket at once while backward goes on:
- no validation (no ``max_grad_norm``, no ``skip_nonfinite``): the step is final, made current at once (into
  the ping-pong spare, swapped in; in place with ``rollback="inverse"``), the previous state kept so that a
  ``zero_grad()`` without ``step()`` can still discard it;
- with validation: speculatively, into the bucket's ping-pong spare (or in place, undone by the algebraic
  inverse, with ``rollback="inverse"``). ``step()`` then validates: commit; or roll back and skip
  (non-finite gradients); or roll back and redo with the clip coefficient. See runtime/speculation.py.
Used eagerly, ``step()`` takes the gradients from ``.grad`` and steps every bucket through the same kernel.

``host_master``: "shared" (fp32 CPU parameters alias the fp32 master; nothing is copied), "separate" (the
parameters keep their dtype and device in one flat buffer per bucket; the fp32 master, gradients and moments
stay on the host and the updated master is uploaded once a step is final; see runtime/host_master.py), or
"auto" (separate as soon as one parameter is not an fp32 CPU tensor: a model on a GPU, or in bf16).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from typing import Iterable

import torch
from torch import nn

from ..options import parse_bytes
from ..plan.host_waits import FIRST_READ, SETTLED, step_returns_before
from ..runtime.device import Runtimes
from ..runtime.events import EventLog
from ..runtime.flat_bucket import FlatBucket
from ..runtime.host_master import upload_order
from ..runtime.memory import HostLedger
from ..runtime.traffic import HostBlockLedger, HostWorkLedger, TrafficLedger
from ..runtime.worker import BucketJobs
from . import state_dict as optimizer_state
from .bucket_layout import BucketSettings, BucketStore
from .graph_claim import ClaimLayout, GraphClaim, GraphOrigin
from .hyper import check_group, check_moment_dtype, hyper_snapshot
from .module_state import ModelStateHooks, _ModuleHook  # noqa: F401  (_ModuleHook: pickled models name it here)
from .owner import previous_owners, release, set_owner
from .settings import check_rollback, resolve_cpu_worker, resolve_host_master
from .state_dict import torch_param_group  # noqa: F401  (imported from here by socompile.distributed)
from .validation import StepOutcome, StepValidation

log = logging.getLogger("socompile")


class AdamW(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, max_grad_norm: float | None = None,
                 bucket_size: int | str = "64MB", grad_accumulation_steps: int = 1, decoupled: bool = True,
                 skip_nonfinite: bool | None = None, rollback: str = "pingpong", predict_clipping: bool = True,
                 cpu_worker: str = "auto", host_master: str = "auto", moment_dtype: torch.dtype = torch.float32):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=decoupled)
        check_group(defaults)   # torch's checks and exception types (socompile/optim/hyper.py)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        if grad_accumulation_steps < 1:
            raise ValueError(f"grad_accumulation_steps must be >= 1, got {grad_accumulation_steps}")
        super().__init__(params, defaults)
        # The runtime (runtime/device.py resolve_runtime: SOCOMPILE_RUNTIME, else CUDA when available, else the
        # CPU): under "emulated" a CPU model is treated as a CUDA one (runtime/emulated_cuda.py).
        from ..runtime.device import resolve_runtime
        self.runtime_kind = resolve_runtime()
        self.cpu_worker = resolve_cpu_worker(cpu_worker, self.runtime_kind)
        self.rollback = check_rollback(rollback)
        self.host_master = resolve_host_master(host_master, self.param_groups, self.runtime_kind)
        self.moment_dtype = check_moment_dtype(moment_dtype, self.rollback)
        self.bucket_size = parse_bytes(bucket_size, "bucket_size")
        self.grad_accumulation_steps = grad_accumulation_steps
        self.events = EventLog()
        # Reference semantics: with clipping, a non-finite norm skips the step (torch would propagate NaN);
        # without clipping, behave as torch.optim.AdamW unless asked.
        self.validation = StepValidation(
            max_grad_norm, (max_grad_norm is not None) if skip_nonfinite is None else skip_nonfinite,
            predict_clipping, self.events, self.upload_bucket)
        self.traffic_ledger = TrafficLedger()   # bytes its copies move over the link, per step (``traffic()``)
        self.host_work_ledger = HostWorkLedger()   # bytes the host CPU reads and writes, per step (``host_work()``)
        self.host_block_ledger = HostBlockLedger()   # where host threads wait on the device or worker (``host_blocks()``)
        self._jobs = BucketJobs(self.host_block_ledger)   # the CPU worker's bucket jobs in flight (its steps, and the ends step() left)
        self._step_ends: dict[int, _StepEnd] = {}   # id(bucket): a step() that returned before its job ended
        self.taken_over = False
        self.runtimes = Runtimes()   # the device runtime (streams) of this optimizer's buckets, per device
        self.host_ledger = HostLedger()   # every host buffer of its buckets (and offloaded activations)
        self.store = BucketStore(
            BucketSettings(self.host_master, self.rollback, self.moment_dtype, self.bucket_size, self.runtime_kind),
            self.runtimes, traffic=self.traffic_ledger, host_ledger=self.host_ledger,
            host_work=self.host_work_ledger, host_blocks=self.host_block_ledger)
        self._own(range(len(self.param_groups)))
        # ZeRO-style data parallelism (socompile.distributed.zero.shard_optimizer sets it): reduce-scatters each
        # bucket's gradients, makes every rank step only its shard, agrees on validation, all-gathers weights.
        self.sharding = None
        self._warned_no_grads = False
        self._rebuild_pool()
        # Separate host master: the model's state_dict() / load_state_dict() go through the host master (flow
        # parameters hold no bytes between uses; a loaded stationary weight must reach the master too).
        self.model_state = ModelStateHooks(self) if self.host_master == "separate" else None

    # NOTE: copies. torch's Optimizer pickles (and deep-copies) defaults, state and param_groups only, which
    # left a copy without the attributes this class sets in __init__ (its buckets, its public settings). A copy
    # is instead built again from its constructor arguments (over the copied parameters, which therefore get
    # buckets of their own) and loads the original's state_dict (moments, step counts, fp32 master of bf16
    # parameters). Hooks are dropped, as torch drops them; compiled graphs stay with the original.
    def __reduce__(self):
        return (_rebuilt, (self.param_groups, self._constructor_arguments(), self.state_dict(),
                           self.validation.outcome))

    def _constructor_arguments(self) -> dict:
        """The keyword arguments that build an optimizer like this one (``cpu_worker`` and ``host_master`` as
        resolved, ``bucket_size`` in bytes); the per-group values are in the param groups."""
        return dict(**{k: self.defaults[k] for k in ("lr", "betas", "eps", "weight_decay", "decoupled")},
                    max_grad_norm=self.max_grad_norm, bucket_size=self.bucket_size,
                    grad_accumulation_steps=self.grad_accumulation_steps, skip_nonfinite=self.skip_nonfinite,
                    rollback=self.rollback, predict_clipping=self.speculator.predict, cpu_worker=self.cpu_worker,
                    host_master=self.host_master, moment_dtype=self.moment_dtype)

    # ------------------------------------------------------------ validation
    # The validation's settings and last outcome, read where torch-style code looks for them.
    @property
    def max_grad_norm(self) -> float | None:
        return self.validation.max_grad_norm

    @property
    def skip_nonfinite(self) -> bool:
        return self.validation.skip_nonfinite

    @property
    def speculator(self):
        return self.validation.speculator

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last validated step (nan when non-finite; None before one)."""
        return self.validation.outcome.grad_norm

    @property
    def last_step_skipped(self) -> bool:
        return self.validation.outcome.skipped

    @property
    def last_step_clipped(self) -> bool:
        return self.validation.outcome.clipped

    # -------------------------------------------------------------- takeover
    def _check_not_taken_over(self) -> None:
        if self.taken_over:
            raise RuntimeError("this socompile.AdamW can no longer be used: its parameters were taken over by a "
                               "newer socompile.AdamW built over the same parameters (e.g. a re-run notebook cell, "
                               "or an optimizer re-created after loading a checkpoint). Use the new optimizer.")

    # ----------------------------------------------------------------- layout
    def all_params(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def buckets(self) -> list[FlatBucket]:
        return self.store.buckets()

    @property
    def param_slots(self) -> dict[int, tuple[FlatBucket, int]]:
        """id(parameter): (its bucket, its index in the bucket), for every bucketed parameter."""
        return self.store.slots

    def add_param_group(self, param_group: dict) -> None:
        """torch's, plus ownership (a compiled graph finds its optimizer through its parameters), after the
        group's own lr / betas / eps / weight_decay pass the constructor's checks (torch checks the defaults
        only: a NaN group lr trained NaN weights)."""
        if isinstance(param_group, dict):
            check_group(param_group, where=f"param group {len(self.param_groups)}: ")
        super().add_param_group(param_group)
        if "store" not in self.__dict__:   # called by Optimizer.__init__: our __init__ registers the groups
            return
        self._own([len(self.param_groups) - 1])
        self._rebuild_pool()

    def _own(self, group_indices) -> None:
        """Become the owner of these param groups' parameters (a compiled graph finds its optimizer through
        them). The newest optimizer over a parameter owns it (optim/owner.py): earlier owners hand theirs back
        first, so the buckets laid out next read each parameter's current weights."""
        params = [p for gi in group_indices for p in self.param_groups[gi]["params"]]
        for previous in previous_owners(params, self):
            previous.hand_over()
        for gi in group_indices:
            for p in self.param_groups[gi]["params"]:
                set_owner(p, self)
                self.store.join_group(p, gi)

    def hand_over(self) -> None:
        """A newer socompile.AdamW was built over (some of) this optimizer's parameters and takes them over.
        This one gives all its parameters back to the model as they are now (the step in flight finished, flow
        weights filled for good, the model's state-dict hooks removed, no owner) and refuses any further use."""
        self.wait_pending()
        self.wait_uploads()
        for bucket in self.buckets:
            bucket.keep_weights()
        if self.model_state is not None:
            self.model_state.remove()
            self.model_state = None
        for p in self.all_params():
            release(p, self)
        self.taken_over = True

    def use_sharding(self, sharding) -> None:
        """ZeRO (socompile.distributed.zero.shard_optimizer): from now on this optimizer's buckets are reduced,
        stepped and gathered through ``sharding`` (its buckets were cut to this rank's shard first)."""
        if self.sharding is not None:
            raise RuntimeError("this optimizer is already sharded")
        self.sharding = sharding

    def _rebuild_pool(self) -> None:
        """Lay out again the buckets of every parameter no active claim holds (optim/bucket_layout.py)."""
        self.store.rebuild_pool(self.all_params(), self.sharding, self.state)

    def claim(self, param_lists: list[list[nn.Parameter]], early_step: list[bool] | None = None,
              rollback: list[str] | None = None, sites: list[str] | None = None,
              weight_modes: list[str] | None = None, link_dtypes: list[str] | None = None,
              cast_sites: list[str] | None = None, origin: GraphOrigin | None = None) -> GraphClaim:
        """Lay out the buckets a compiled backward graph feeds (called by the backend at compile time).
        ``early_step[i]``: bucket i may be stepped by the CPU worker as its gradients arrive; otherwise (a
        device-resident bucket, or speculation turned off) it is stepped in ``step()`` after validation.
        ``rollback[i]``: the plan's rollback mode of bucket i ("pingpong" or "inverse"); default: the
        optimizer's ``rollback`` argument. ``sites[i]``: the plan's optimizer site ("cpu" or "device") and
        ``weight_modes[i]`` ("stationary" or "flow"): with a separate host master they place the bucket's state
        on the device, or free its device weights between uses. ``link_dtypes[i]`` (the plan's link dtype: the
        dtype gradients cross the link in, so the dtype of the host landing buffer of a separate master) and
        ``cast_sites[i]`` (where bf16 weights are cast from the fp32 master: "cpu" or "device").
        ``origin``: the graph's Dynamo frame.
        A recompile of the same graph (same parameters) gets its existing claim back; a new graph takes the
        parameters it shares with older claims over (see graph_claim.py), unless both are pieces of one
        graph-broken region, whose backward passes would both produce the shared gradients."""
        self._check_not_taken_over()
        self.wait_pending()
        layout = ClaimLayout.of(param_lists, early_step, rollback, sites, weight_modes, link_dtypes, cast_sites)
        if any(i not in self.store.group_index for i in layout.key):
            raise ValueError("the compiled graph's parameter is not in this optimizer")
        claim = self.store.claims.get_or_add(self, layout, origin or GraphOrigin())
        self.activate_claim(claim)
        return claim

    def activate_claim(self, claim: GraphClaim) -> None:
        """Lay out ``claim``'s buckets, adopting its parameters' state from wherever it is; the active claims
        that held some of them go stale, their other parameters go to the pool."""
        if claim.active:
            return
        self.wait_pending()
        self.store.claims.take_over(claim)
        claim.buckets[:] = self.store.make(sharding=self.sharding, state=self.state, **claim.layout.bucket_args())
        for bucket, mode in zip(claim.buckets, claim.layout.rollback or ()):
            if mode != "pingpong" and bucket.moments_rounded:
                raise ValueError(
                    f"socompile.AdamW(moment_dtype={self.moment_dtype}): the compiled plan undoes bucket "
                    f"{bucket.index}'s speculative step with the algebraic inverse (rollback 'inverse', chosen to "
                    f"fit host memory), which {'int8' if self.moment_dtype == 'int8' else 'bf16'} moments cannot use "
                    f"(they are rounded stochastically: no inverse gives them back). Use fp32 moments for this model, "
                    f"or plan for a host with more memory.")
            bucket.use_rollback(mode)
        for runtime in getattr(claim, "offload_runtimes", ()):   # the graph's device staging of its uploads
            runtime.attach_buckets()
        claim.laid_out()
        self._rebuild_pool()

    # ------------------------------------------------------------- backward
    def receive_gradients(self, bucket: FlatBucket, segments: list[int], grads: list[torch.Tensor],
                  may_speculate: bool = True) -> None:
        """Called from inside the compiled backward when all of ``bucket``'s gradients exist."""
        self._check_not_taken_over()
        if self._jobs.has_then(bucket):   # the end of the last step() is still with the bucket's job: end it first
            self._jobs.wait(bucket, "backward: the end of the last step")
        if bucket.arrivals >= self.grad_accumulation_steps:
            raise RuntimeError(f"backward ran {bucket.arrivals + 1} times before opt.step(), but the socompile "
                               f"optimizer expects {self.grad_accumulation_steps}. Call opt.step() after each "
                               "backward, or set grad_accumulation_steps=N on socompile.AdamW to accumulate N "
                               "backward passes per step.")
        self.events.record("grads_ready", bucket.index)
        if bucket.mirror:   # .grad stays None: the gradients live in the host buffer (copied, maybe async)
            bucket.receive_many(segments, grads, accumulate=True)
        else:
            for i, grad in zip(segments, grads):
                p = bucket.params[i]
                bucket.receive(i, grad, accumulate=p.grad is not None)
                p.grad = bucket.view(bucket.grad, i)
        bucket.note_gradients_delivered()
        if bucket.gradients_arrived() == self.grad_accumulation_steps and self.sharding is not None:
            self.sharding.start_reduce(bucket)   # in graph order: the same order on every rank
        # Only the last micro-batch's gradients are final: earlier ones just accumulate.
        if bucket.arrivals == self.grad_accumulation_steps and may_speculate:
            # ZeRO: the training thread issues the collectives in graph order and the worker thread waits for
            # them; waiting inline, between the issues, deadlocked gloo ranks (tests/test_dist_checkpoint.py).
            if self.cpu_worker == "inline" and self.sharding is None:
                self._on_bucket_complete(bucket)
            else:
                booked_in = self.traffic_ledger.steps   # its copies are this step's, whenever they are queued
                groups = hyper_snapshot(self.param_groups)   # this step's lr, whenever the job starts
                self._jobs.submit(bucket, lambda: self._booked_in(
                    booked_in, lambda: self._on_bucket_complete(bucket, groups)))

    def _booked_in(self, step: int, fn):
        """Run ``fn`` (a CPU job) with its link copies and host-CPU passes booked in step ``step``."""
        return self.traffic_ledger.booking(step, lambda: self.host_work_ledger.booking(
            step, lambda: self.host_block_ledger.booking(step, fn)))

    def _on_bucket_complete(self, bucket: FlatBucket, groups: list[dict] | None = None) -> None:
        """Worker thread: the bucket's gradients on the host (and reduced, under ZeRO), then its step or
        speculation (``StepValidation.on_gradients``). ``groups``: the param groups' hyperparameters when the job
        was queued (``hyper_snapshot``)."""
        bucket.wait_grads()   # CUDA: this bucket's gradient copy to the host (its event only)
        if self.sharding is not None:
            self.sharding.finish_reduce(bucket)   # this rank's shard of the averaged gradients
        self.validation.on_gradients(bucket, self.param_groups if groups is None else groups, self.sharding)

    def held_gradient(self, p: torch.Tensor):
        """(bucket, host gradient) of ``p`` where this optimizer holds its gradient off ``.grad`` (a separate
        host master), for a training script's own clipping (optim/script_clip.py); else None. Waits for the
        CPU jobs in flight first: the worker may be stepping from these gradients."""
        slot = self.param_slots.get(id(p))
        if slot is None or not slot[0].mirror:
            return None
        self.wait_pending()
        bucket, i = slot
        if self.sharding is not None and bucket.has_grad[i]:
            raise RuntimeError(
                "torch.nn.utils.clip_grad_norm_ / clip_grad_value_ on parameters of a ZeRO-sharded socompile.AdamW: "
                "each rank holds only its shard of the reduced gradients. Pass max_grad_norm=... to "
                "socompile.AdamW (it clips over the global norm) and drop the script's clip.")
        held = bucket.held_gradient(i)
        return None if held is None else (bucket, held)

    def sharding_active(self) -> bool:
        """Whether ZeRO-style sharding splits this optimizer's buckets over ranks."""
        return self.sharding is not None

    def wait_pending(self, site: str = "opt.wait_pending") -> None:
        """Wait for every CPU job in flight (and end the steps that returned before theirs ended): a kernel
        error is raised here, in the training loop, naming its bucket. ``site``: who waits (``host_blocks()``)."""
        jobs = self.__dict__.get("_jobs")
        if jobs is not None:
            jobs.wait_all(site)

    def wait_bucket(self, bucket: FlatBucket) -> None:
        """The training thread is about to need ``bucket``'s host state (the next forward's first read of its
        weights): wait for its CPU job only, and end the step that ``step()`` left to it."""
        self._jobs.wait(bucket, FIRST_READ)

    # NOTE: opt.state is read after the CPU jobs step() did not wait for: its moments and step counts are
    # final (as after torch's step()) whenever a script, a scheduler or a checkpoint reads them.
    @property
    def state(self):
        self.wait_pending()
        return self.__dict__["_state"]

    @state.setter
    def state(self, value) -> None:
        self.__dict__["_state"] = value

    def state_without_waiting(self):
        """``opt.state`` as it is now, for the runtime's own bookkeeping while it ends one bucket's step."""
        return self.__dict__["_state"]

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        held = state.pop("state", None)
        super().__setstate__(state)
        if held is not None:
            self.state = held

    def _may_return_before(self, buckets: list[FlatBucket], script_changed: list[FlatBucket]) -> set[int]:
        """ids of the buckets whose CPU step ``step()`` need not wait for: a final step with nothing to
        validate (ping-pong: taken into the spare and swapped in by the job itself), whose updated weights
        the next compiled forward waits for right before its first read (``graph_waits_upload``; a flowing
        bucket: its fetch waits for the job, ``graph_fetches``). Every other
        bucket is waited for: validation decides over all of them; ZeRO all-gathers after the step; a
        script's own gradient change is redone in step(); an unread bucket has nobody else to wait for it."""
        if script_changed:
            return set()
        validating, sharded = self.validation.active, self.sharding is not None
        return {id(b) for b in buckets if self._jobs.running(b) and not self._jobs.has_then(b)
                and step_returns_before(validating=validating, sharded=sharded, mirror=b.mirror,
                                        graph_waits=b.graph_waits_upload or b.graph_fetches,
                                        pingpong=b.rollback_mode == "pingpong")}

    def _end_step_of(self, bucket: FlatBucket) -> None:
        """The end of a ``step()`` that returned before ``bucket``'s CPU job ended (training thread, once the
        job has ended): its step counts and ``opt.state``, as ``step()`` does for the others."""
        end = self._step_ends.pop(id(bucket))
        self.validation.commit([bucket], self.state_without_waiting(), has_grad=[end.has_grad])
        bucket.reset_iteration()
        if end.zeroed:
            bucket.clear_gradients()

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        self._check_not_taken_over()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for bucket in self.buckets:
            if self._jobs.has_then(bucket):   # a step() without a forward since the last one
                self._jobs.wait(bucket, "step: the last step's end")
        if self._has_new_trainables():
            self.wait_pending()
            self._rebuild_pool()
        buckets = self.buckets  # a fixed order, so the global norm is summed the same way every time
        script_changed = [b for b in buckets if b.script_changed_gradients()]
        later = self._may_return_before(buckets, script_changed)
        for bucket in buckets:
            if id(bucket) not in later:
                self._jobs.wait(bucket, SETTLED)
        if script_changed:
            self.validation.undo_for_script_gradients(script_changed, self.param_groups, self.sharding)
        settled = [b for b in buckets if id(b) not in later]
        for bucket in settled:
            if not bucket.stepped and bucket.speculated is None:
                bucket.gather_eager_grads()
            bucket.wait_grads()
        if not self._warned_no_grads and not any(any(b.has_grad) for b in buckets):
            self._warned_no_grads = True  # torch steps nothing silently; say why once, it is usually a bug
            log.warning("socompile.AdamW.step(): none of its %d parameter(s) has a gradient. Was backward run "
                        "on a model whose parameters are not this optimizer's (a copy, or a module re-created "
                        "after the optimizer)? Build the optimizer from the trained model's parameters.",
                        sum(len(b.params) for b in buckets))
        if self.sharding is not None:
            self.sharding.reduce_remaining(buckets)
        # state_without_waiting: the jobs step() returns before end their buckets' commits themselves
        if self.validation.active:
            self.validation.finish(buckets, self.param_groups, self.sharding, self.state_without_waiting(),
                                   script_changed=bool(script_changed))
        else:
            self.validation.finish_unvalidated(settled, self.param_groups, self.sharding,
                                               self.state_without_waiting())
            for bucket in buckets:   # the job steps, swaps in and uploads; the forward's first read waits for it
                if id(bucket) in later:
                    self._step_ends[id(bucket)] = _StepEnd(has_grad=list(bucket.has_grad))
                    self._jobs.then(bucket, lambda b=bucket: self._end_step_of(b))
            self.speculator.count_unvalidated_step()
        if self.sharding is not None:
            self.sharding.gather(buckets, changed=not (self.validation.active and self.last_step_skipped))
        self.upload_buckets(settled)
        for bucket in settled:
            bucket.reset_iteration()
        self.events.record("step_return")
        self.speculator.begin_step()
        self.traffic_ledger.end_step()
        self.host_work_ledger.end_step()
        self.host_block_ledger.end_step()
        return loss

    def traffic(self) -> dict[tuple[str, str, str], int]:
        """Bytes the runtime moved over the host-device link in the last step (from the end of the previous
        ``step()`` to the end of the last one: its forwards, backwards and step), by (direction, dtype,
        purpose): direction "d2h" or "h2d", dtype the name of what crossed ("bfloat16", "float32"), purpose
        "gradients", "weight upload", "flow fetch", "activation offload" or "activation fetch"
        (runtime/traffic.py). The plan predicts the same dict (socompile.plan.transfers.per_step_traffic).
        Waits for the CPU jobs in flight first: an upload a job queues after ``step()`` returned is its step's."""
        self.wait_pending()
        return dict(self.traffic_ledger.last)

    def host_work(self) -> dict[str, tuple[int, int]]:
        """Bytes the host CPU read and wrote for the optimizer's runtime in the last step (counted as
        ``traffic()`` is), by purpose: {purpose: (read, written)}, purposes of plan/host_work.py ("adam kernel",
        "norm pass", "accumulation add", "gradient copy", "upload copy", "spare copy", "host cast", "inverse
        step"). The plan predicts the same (socompile.plan.host_work.per_step_host_work)."""
        self.wait_pending()
        return self.host_work_ledger.by_purpose()

    def host_blocks(self) -> dict[tuple[str, str, str], dict[str, int]]:
        """Where host threads waited in the last step (counted as ``traffic()`` is): {(thread, kind, site):
        {"calls": n, "blocked": m}}, thread "training" or "worker", kind "event synchronize" (a device copy's
        completion), "CPU worker job" or "device value read" (float() of a device tensor); ``blocked``: the
        calls that found the work not done yet (runtime/traffic.py HostBlockLedger). Read before the next
        step's work: it waits for nothing itself."""
        return self.host_block_ledger.by_site()

    def upload_bucket(self, bucket: FlatBucket) -> None:
        """Make ``bucket``'s device weights its final master's (``FlatBucket.upload``), recorded in ``events`` as
        an ``upload`` span where the bucket mirrors its master on a device (CUDA: when the copy was queued on the
        h2d stream and handed back; the CPU build and the emulated device: the copy itself)."""
        if not bucket.mirror:
            bucket.upload()
            return
        self.events.record("upload_start", bucket.index)
        bucket.upload()
        self.events.record("upload_end", bucket.index)

    def upload_buckets(self, buckets: list[FlatBucket]) -> None:
        """Separate host master: upload every bucket whose master still changed since its last upload (ZeRO's
        all-gather, a loaded state), then make the compute stream wait for the uploads that no compiled forward
        waits for itself (``graph_waits_upload``: passes/wait_uploads.py puts that wait right before the
        bucket's first read), so eager use reads the new weights (CUDA: queued waits, no host block; CPU
        build: the copies are already done)."""
        for bucket in upload_order(buckets):
            if bucket.dirty:
                self.upload_bucket(bucket)
        for bucket in buckets:
            if bucket.mirror and not bucket.graph_waits_upload:
                bucket.wait_upload_on_compute()

    def wait_uploads(self) -> None:
        """Make the compute stream wait for every upload issued so far (a queued wait on CUDA, nothing on the
        CPU build). Compiled training needs no call: its forward waits per bucket before the first read. Call
        it before reading stationary parameters of a compiled model outside its training graph between
        ``opt.step()`` and the next compiled forward (an eager or ``torch.no_grad()`` evaluation, a copy);
        ``materialized_weights()`` and ``model.state_dict()`` call it."""
        self.wait_pending()   # uploads a CPU job issues after step() returned
        for bucket in self.buckets:
            bucket.wait_upload_on_compute()

    def host_memory(self) -> dict:
        """Host memory this optimizer's runtime holds, from its ledger (runtime/memory.py HostLedger): bytes
        now (``current``, ``pinned``, ``pageable``), the ``peak``, and both by purpose (``by_purpose``,
        ``peak_by_purpose``: {purpose: {"pinned": bytes, "pageable": bytes}}): fp32 master, Adam moments,
        ping-pong spares, gradient landing, gradient accumulation stage, bf16 staging copy, offloaded
        activations. The plan predicts the same (plan/memory.py host_buffers; docs/runtime.md)."""
        gc.collect()   # buffers only a reference cycle still held (a bucket laid out again) leave the books
        return self.host_ledger.host_summary()

    @property
    def stats(self) -> dict:
        """Counters: steps (every step(), validated or not), skipped and clipped ones; buckets speculated,
        committed, rolled back, redone, held; steps a script changed the gradients of; time in each."""
        return self.speculator.stats.as_dict()

    def _has_new_trainables(self) -> bool:
        return any(id(p) not in self.param_slots and p.grad is not None for p in self.all_params())

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's: the gradients are discarded. Without a step() since the last backward, so is everything
        that backward started: speculative steps are rolled back and steps taken final during backward are
        undone (a step the user skipped: a NaN loss, an LR finder), and the next backward starts afresh."""
        self._check_not_taken_over()
        for bucket in self.buckets:
            if id(bucket) not in self._step_ends:   # a step() that returned is not discarded: no need to wait
                self._jobs.wait(bucket, "zero_grad")
        if self.sharding is not None:   # ZeRO: reductions the discarded backward started are dropped too
            self.sharding.discard(self.buckets)
        ended_later = []
        for bucket in self.buckets:
            end = self._step_ends.get(id(bucket))
            if end is not None:   # its job may still read the gradients: the bucket's end forgets them
                end.zeroed = True
                ended_later.append(bucket)
                for p in bucket.params:
                    if p.grad is not None:   # not the host gradients (a separate master's .grad is the script's)
                        p.grad = None if set_to_none else p.grad.zero_()
                continue
            self.validation.discard_iteration(bucket, self.param_groups)
            for p in bucket.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
            bucket.clear_gradients()
        for p in self.all_params():
            if id(p) not in self.param_slots and p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()
        self.speculator.begin_step()
        # separate host master: weights uploaded during backward are undone too
        self.upload_buckets([b for b in self.buckets if all(b is not e for e in ended_later)])

    # ------------------------------------------------------------ checkpoints
    def state_dict(self):
        """torch.optim.AdamW's layout: ``state[i] = {"step", "exp_avg", "exp_avg_sq"}`` (fp32, the parameter's
        shape; "step" a float32 scalar tensor), and param groups with torch's keys, so ``torch.optim.AdamW``
        loads it as is. Tensors are views of the live buckets (as torch returns its live state): save or clone
        them before training on. Call it after ``opt.step()``, not between backward and step.

        A ZeRO-sharded optimizer holds only its shards of the moments: use socompile.distributed.save / load
        (torch.distributed.checkpoint), or ``full_optimizer_state_dict`` to gather this layout on one rank."""
        return optimizer_state.save(self)

    def load_state_dict(self, state_dict, *, checked: bool = False) -> None:
        """Load a state dict of socompile.AdamW or of torch.optim.AdamW (same layout). Parameters without a
        state in it start fresh (step 0, zero moments), as in torch. The state is validated first (shapes,
        finite moments, step counts: optim/state_dict.check_state_dict) unless ``checked``: the caller has
        just done so (socompile.load checks before it loads the model, naming the file)."""
        self._check_not_taken_over()
        optimizer_state.load(self, state_dict, checked=checked)

    @contextlib.contextmanager
    def materialized_weights(self, pull: bool = False):
        """Weight-flow buckets with a separate host master hold no device bytes between uses (their storage is
        resized to 0, and reading such a parameter is an invalid memory access). Inside this block every
        parameter holds its weights (cast from the master), e.g. to save or load the model's state dict or to
        run it eagerly; with ``pull=True`` values written into the parameters go into the master at exit.
        Stationary weights whose upload is still in flight (CUDA) are waited for first (``wait_uploads``)."""
        self.wait_pending()
        self.wait_uploads()
        with contextlib.ExitStack() as stack:
            for bucket in self.buckets:
                stack.enter_context(bucket.materialized(pull=pull))
            yield
        if pull:
            self.upload_buckets(self.buckets)
            self.wait_uploads()

    def __del__(self):
        if getattr(self, "sharding", None) is not None:   # device-side ZeRO: the model keeps no weights that are
            with contextlib.suppress(Exception):          # still being all-gathered (distributed/zero_gather.py)
                self.wait_uploads()
        if getattr(self, "model_state", None) is not None:
            self.model_state.remove()
        if getattr(self, "_jobs", None) is not None:
            self._jobs.shutdown()


def _rebuilt(param_groups: list[dict], arguments: dict, state_dict: dict, outcome: StepOutcome) -> AdamW:
    """A copy of a pickled or deep-copied AdamW (see ``AdamW.__reduce__``)."""
    opt = AdamW(param_groups, **arguments)
    opt.load_state_dict(state_dict)
    opt.validation.remember(outcome)
    return opt


@dataclasses.dataclass
class _StepEnd:
    """What ``step()`` knew of a bucket whose CPU job it did not wait for: which parameters had gradients, and
    whether ``zero_grad()`` came since (the bucket's end then forgets them, as zero_grad does for the others)."""
    has_grad: list[bool]
    zeroed: bool = False
