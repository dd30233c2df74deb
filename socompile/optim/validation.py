"""The steps of socompile.AdamW's buckets and their validation (``max_grad_norm``, ``skip_nonfinite``).

``StepValidation`` owns the speculator, the validation settings and the last step's outcome. Backward hands it
each bucket whose gradients are complete (``on_gradients``): with nothing to validate the step is final at
once; otherwise it is speculated, or held when clipping is certain or predicted. ``step()`` then sums the
buckets' norm partials into the global gradient norm and, per bucket: commits the speculated step, or rolls
it back and skips the step (a non-finite norm), or rolls it back and redoes it with the clip coefficient
(runtime/speculation.py); a bucket not stepped yet is stepped now, and each is uploaded as soon as it is
final. ``zero_grad()`` without ``step()`` discards what the backward started (``discard_iteration``).
The optimizer's state (``opt.state``, torch's layout) is made current by ``commit``.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from typing import Callable

import torch

from ..runtime import ranges
from ..runtime.cpu_adam import grad_stats, rollback_inplace, step_bucket
from ..runtime.events import EventLog
from ..runtime.flat_bucket import FlatBucket
from ..runtime.host_master import upload_order
from ..runtime.speculation import Speculator, clip_coefficient
from .bucket_layout import alias_state

log = logging.getLogger("socompile")


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What validation decided for a step: the global gradient norm (nan when non-finite), whether the step was
    skipped (non-finite gradients) or clipped (the optimizer's max_grad_norm scaled it)."""
    grad_norm: float | None   # None before the first validated step
    skipped: bool = False
    clipped: bool = False


class StepValidation:
    """How socompile.AdamW takes and validates its buckets' steps. ``events``: the optimizer's event log;
    ``upload``: makes a bucket's final master the device's weights (``AdamW.upload_bucket``). The buckets are
    worked on through their public methods; the param groups, the ZeRO sharding (or None) and ``opt.state`` are
    the optimizer's, handed in per call."""

    def __init__(self, max_grad_norm: float | None, skip_nonfinite: bool, predict_clipping: bool,
                 events: EventLog, upload: Callable[[FlatBucket], None]):
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.speculator = Speculator(max_grad_norm, predict=predict_clipping)
        self.outcome = StepOutcome(grad_norm=None)
        self._events = events
        self._upload = upload
        self._warned_script_clip = False   # said once: a script's clip and max_grad_norm both present

    @property
    def active(self) -> bool:
        """Whether steps are validated (clipping or skip-on-overflow): backward's steps are then speculative."""
        return self.max_grad_norm is not None or self.skip_nonfinite

    def remember(self, outcome: StepOutcome) -> None:
        """Take ``outcome`` as the last step's (a copy of an optimizer keeps the original's)."""
        self.outcome = outcome

    # ------------------------------------------------------------- backward
    def on_gradients(self, bucket: FlatBucket, groups: list[dict], sharding) -> None:
        """The CPU worker (or backward, inline): ``bucket``'s gradients are complete and on the host. Without
        validation its step is final; with it, speculate the step if still worthwhile, and always learn the
        bucket's norm partial. ``groups``: the hyperparameters when the job was queued (``hyper_snapshot``)."""
        start = time.perf_counter()
        if not self.active:
            self._step_unvalidated(bucket, groups, sharding)
            return
        spec = self.speculator
        if not spec.may_speculate():
            bucket.learn_partial(grad_stats(bucket))
            spec.count_held()
        elif bucket.rollback_mode == "pingpong":
            self._events.record("step_start", bucket.index)
            bucket.learn_partial(step_bucket(bucket, groups, into_spare=True))
            bucket.speculated_into("spare")
            self._events.record("step_end", bucket.index)
        else:  # memory-tight: one copy of the state, undone by the algebraic inverse if needed
            bucket.learn_partial(grad_stats(bucket))
            if not bucket.partial[1]:  # the inverse cannot undo a step that saw NaN/Inf: never take one
                self._events.record("step_start", bucket.index)
                step_bucket(bucket, groups)
                bucket.speculated_into("inplace")
                self._events.record("step_end", bucket.index)
        if bucket.speculated:
            spec.count_speculated(time.perf_counter() - start)
        spec.add_partial(*bucket.partial)

    def _step_unvalidated(self, bucket: FlatBucket, groups: list[dict], sharding) -> None:
        """Nothing to validate: the step taken now is final unless zero_grad() discards it (a step the user
        skipped), so the previous state is kept where the plan budgets for it: ping-pong steps into the spare
        and swaps it in at once (the spare keeps the old state); the inverse never steps over a non-finite
        gradient (it could not undo it), step() takes that one."""
        if bucket.rollback_mode != "pingpong" and grad_stats(bucket)[1]:
            return
        self._events.record("step_start", bucket.index)
        if bucket.rollback_mode == "pingpong":
            step_bucket(bucket, groups, into_spare=True)
            bucket.swap_in_spare()
        else:
            step_bucket(bucket, groups)
        bucket.stepped_final()
        if sharding is None:   # ZeRO: only this rank's window is new; step() uploads after the gather
            self._upload(bucket)   # separate host master: the new weights go while backward goes on
        self._events.record("step_end", bucket.index)

    # ----------------------------------------------------------------- step
    @ranges.ranged(ranges.VALIDATE)
    def finish(self, buckets: list[FlatBucket], groups: list[dict], sharding, state: dict,
               script_changed: bool = False) -> StepOutcome:
        """Validation: commit the speculated steps, or roll them back and skip (non-finite gradients), or
        roll them back and redo them with clipped gradients. ``script_changed``: the training script changed the
        gradients after backward (``undo_for_script_gradients`` ran); its gradients are used as it left them, and
        ``max_grad_norm`` is not applied on top, so that clipping happens once (the script's, as torch would)."""
        start = time.perf_counter()
        spec = self.speculator
        total, nonfinite = 0.0, False
        for bucket in buckets:
            if bucket.partial is None:
                bucket.learn_partial(grad_stats(bucket))
            total, nonfinite = total + bucket.partial[0], nonfinite or bucket.partial[1]
        if sharding is not None:   # partials cover this rank's shards: every rank must decide alike
            total, nonfinite = sharding.global_stats(total, nonfinite)
        norm = math.sqrt(total) if not nonfinite and math.isfinite(total) else float("nan")
        speculated = [b for b in buckets if b.speculated]
        self._events.record("validate")
        if not math.isfinite(norm):
            for bucket in speculated:
                self.roll_back(bucket, groups)
                self.upload_final(bucket, sharding)   # an in-place rollback rewrote the master (inverse)
            skipped, clipped = True, False
            self._events.record("skip")
        else:
            scale = 1.0 if script_changed else clip_coefficient(norm, self.max_grad_norm)
            skipped, clipped = False, scale < 1.0
            self._make_final(buckets, groups, sharding, state, scale)
        spec.end_step(norm, skipped=skipped, clipped=clipped)
        spec.count_validating(time.perf_counter() - start)
        if log.isEnabledFor(logging.DEBUG):   # TORCH_LOGS=+socompile shows one line per step
            log.debug("socompile step %d: norm %.4g, %s; speculation so far %s", spec.stats.steps, norm,
                      "skipped" if skipped else "clipped" if clipped else "committed",
                      spec.stats.as_dict())
        self.outcome = StepOutcome(norm, skipped, clipped)
        return self.outcome

    def finish_unvalidated(self, buckets: list[FlatBucket], groups: list[dict], sharding, state: dict) -> None:
        """``step()`` with nothing to validate, for the buckets it waited for: step those backward did not,
        upload each as it is final, and commit them."""
        self._make_final(buckets, groups, sharding, state, 1.0)

    def _make_final(self, buckets: list[FlatBucket], groups: list[dict], sharding, state: dict,
                    scale: float) -> None:
        """Make every bucket's step final with gradient scale ``scale`` and commit them: a speculated step is kept
        (scale 1) or rolled back and redone scaled; a bucket not stepped yet is stepped now. Each bucket's upload
        is issued as soon as it is final (overlapping the next buckets' commits or steps), in the order the next
        forward reads them."""
        spec = self.speculator
        for bucket in upload_order(buckets):
            if bucket.speculated and scale < 1.0:
                self.roll_back(bucket, groups)
                self.step_now(bucket, groups, scale)
                spec.count_redone()
            elif bucket.speculated:
                if bucket.speculated == "spare":
                    bucket.swap_in_spare()
                spec.count_committed()
            elif not bucket.stepped:
                self.step_now(bucket, groups, scale)
            self.upload_final(bucket, sharding)
        self.commit(buckets, state)

    def roll_back(self, bucket: FlatBucket, groups: list[dict]) -> None:
        """Undo ``bucket``'s speculated step."""
        if bucket.speculated == "inplace":
            rollback_inplace(bucket, groups, grad_scale=1.0)
        # "spare": the current state was never written; dropping the spare is the rollback.
        bucket.speculated_into(None)
        self.speculator.count_rolled_back()
        self._events.record("rollback", bucket.index)

    def commit(self, buckets: list[FlatBucket], state: dict, has_grad: list[list[bool]] | None = None) -> None:
        """The steps are final: count them and show the current moments in ``state`` (``opt.state``, torch's
        layout). ``has_grad``: per bucket, which parameters were stepped (default: the buckets' own)."""
        for k, bucket in enumerate(buckets):
            stepped = bucket.has_grad if has_grad is None else has_grad[k]
            for i, p in enumerate(bucket.params):
                if not stepped[i]:
                    continue
                bucket.steps[i] += 1
                entry = state[p]
                if "step" not in entry:
                    entry["step"] = torch.tensor(0.0)
                alias_state(bucket, i, entry)   # the current copy (a ping-pong commit may have swapped it)
                entry["step"].fill_(float(bucket.steps[i]))
        self._events.record("commit")

    def discard_iteration(self, bucket: FlatBucket, groups: list[dict]) -> None:
        """``zero_grad()`` without ``step()``: undo whatever the backward started on ``bucket``."""
        bucket.wait_grads()
        if bucket.speculated:
            self.roll_back(bucket, groups)
        elif bucket.stepped:   # taken final during backward (no validation), kept undoable there
            if bucket.rollback_mode == "pingpong":
                bucket.swap_in_spare()   # the spare holds the state before the step, whole
            else:
                rollback_inplace(bucket, groups, grad_scale=1.0)
            self._events.record("rollback", bucket.index)
        bucket.reset_iteration()

    def undo_for_script_gradients(self, buckets: list[FlatBucket], groups: list[dict], sharding) -> None:
        """The training script changed these buckets' gradients between ``backward()`` and ``step()`` (its own
        ``clip_grad_norm_``, ``clip_grad_value_``, ``GradScaler.unscale_``, a manual ``mul_``). What backward
        stepped or speculated from the gradients as they were is undone here, exactly (the ping-pong spare), and
        ``step()`` then steps from the gradients as the script left them: the same parameters as torch's AdamW
        after the same call. An in-place step (``rollback="inverse"``) cannot be undone once its gradients
        changed (the inverse needs them), so that case is refused before anything else is touched."""
        self.speculator.count_script_changed()
        for bucket in buckets:
            inplace = bucket.speculated == "inplace" or (bucket.stepped and bucket.rollback_mode != "pingpong")
            if inplace:
                raise RuntimeError(
                    f"socompile.AdamW.step(): the training script changed the gradients of bucket {bucket.index} "
                    f"between backward() and step() (e.g. torch.nn.utils.clip_grad_norm_), after backward had "
                    f"stepped that bucket in place (rollback='inverse'), whose undo needs the gradients it stepped "
                    f"with. Pass max_grad_norm=... to socompile.AdamW and drop the script's clip, or use "
                    f"rollback='pingpong'.")
        if sharding is not None:
            raise RuntimeError(
                "socompile.AdamW.step(): the training script changed the gradients between backward() and step() "
                "(e.g. torch.nn.utils.clip_grad_norm_), but under ZeRO each rank holds only its shard of the "
                "reduced gradients. Pass max_grad_norm=... to socompile.AdamW (it clips over the global norm) and "
                "drop the script's clip.")
        if self.max_grad_norm is not None and not self._warned_script_clip:
            self._warned_script_clip = True
            warnings.warn(
                f"socompile.AdamW: the training script changed the gradients between backward() and step() (its "
                f"own clip_grad_norm_ or similar). They are used as the script left them, and the optimizer's "
                f"max_grad_norm={self.max_grad_norm} is not applied on top: clipping happens once, the script's. "
                f"Keep one of the two; with max_grad_norm alone, clipping is known while backward steps the "
                f"buckets and no bucket is stepped twice.", stacklevel=3)
        for bucket in buckets:
            bucket.wait_grads()
            if bucket.speculated:
                self.roll_back(bucket, groups)
            elif bucket.stepped:
                bucket.swap_in_spare()   # the spare holds the state before backward's step, whole
                bucket.stepped_final(False)
                self._events.record("rollback", bucket.index)
            bucket.take_script_gradients()
            bucket.learn_partial(None)   # the norm partial is taken again, of the script's gradients
        self._events.record("script_gradients")

    def step_now(self, bucket: FlatBucket, groups: list[dict], grad_scale: float) -> None:
        """Step ``bucket`` now, final (no speculation: validated already, or nothing to validate)."""
        self._events.record("step_start", bucket.index)
        step_bucket(bucket, groups, grad_scale)
        bucket.stepped_final()
        self._events.record("step_end", bucket.index)

    def upload_final(self, bucket: FlatBucket, sharding) -> None:
        """Separate host master: upload ``bucket`` as soon as its step is final (committed, redone, stepped
        now, rolled back by the inverse), so its copy overlaps the rest of ``step()`` and the next forward.
        ZeRO: not yet; only this rank's window is new until the all-gather (``upload_buckets`` after it)."""
        if bucket.dirty and sharding is None:
            self._upload(bucket)
