"""The end of socompile.AdamW's step with validation (``max_grad_norm``, ``skip_nonfinite``), and its undo.

``step()`` sums the buckets' norm partials into the global gradient norm and then, per bucket: commits the
speculated step, or rolls it back and skips the step (a non-finite norm), or rolls it back and redoes it with
the clip coefficient (runtime/speculation.py); a bucket not stepped yet is stepped now (``step_now``), and each
is uploaded as soon as it is final (``upload_final``). ``zero_grad()`` without ``step()`` discards what the
backward started (``discard_iteration``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from typing import TYPE_CHECKING

import torch

from ..runtime import ranges
from ..runtime.cpu_adam import grad_stats, rollback_inplace, step_bucket
from ..runtime.flat_bucket import FlatBucket
from ..runtime.host_master import upload_order
from ..runtime.speculation import clip_coefficient
from .bucket_layout import alias_state

if TYPE_CHECKING:
    from .adamw import AdamW

log = logging.getLogger("socompile")


@ranges.ranged(ranges.VALIDATE)
@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What validation decided for a step: the global gradient norm (nan when non-finite), whether the step was
    skipped (non-finite gradients) or clipped (the optimizer's max_grad_norm scaled it)."""
    grad_norm: float
    skipped: bool
    clipped: bool


def validate_and_finish(opt: "AdamW", buckets: list[FlatBucket], script_changed: bool = False) -> StepOutcome:
    """Validation: commit the speculated steps, or roll them back and skip (non-finite gradients), or
    roll them back and redo them with clipped gradients. ``script_changed``: the training script changed the
    gradients after backward (``undo_for_script_gradients`` ran); its gradients are used as it left them, and
    ``max_grad_norm`` is not applied on top, so that clipping happens once (the script's, as torch would)."""
    start = time.perf_counter()
    spec = opt.speculator
    total, nonfinite = 0.0, False
    for bucket in buckets:
        if bucket.partial is None:
            bucket.learn_partial(grad_stats(bucket))
        total, nonfinite = total + bucket.partial[0], nonfinite or bucket.partial[1]
    if opt.sharding is not None:   # partials cover this rank's shards: every rank must decide alike
        total, nonfinite = opt.sharding.global_stats(total, nonfinite)
    norm = math.sqrt(total) if not nonfinite and math.isfinite(total) else float("nan")
    speculated = [b for b in buckets if b.speculated]
    opt.events.record("validate")
    if not math.isfinite(norm):
        for bucket in speculated:
            roll_back(opt, bucket)
            upload_final(opt, bucket)   # an in-place rollback rewrote the master (inverse)
        skipped, clipped = True, False
        opt.events.record("skip")
    else:
        scale = 1.0 if script_changed else clip_coefficient(norm, opt.max_grad_norm)
        skipped, clipped = False, scale < 1.0
        # Each bucket is final here, one by one: its upload is issued at once (overlapping the next
        # buckets' commits or redone steps), in the order the next forward reads them.
        for bucket in upload_order(buckets):
            if bucket.speculated and scale < 1.0:
                roll_back(opt, bucket)
                step_now(opt, bucket, scale)
                spec.stats.redone += 1
            elif bucket.speculated:
                if bucket.speculated == "spare":
                    bucket.swap_in_spare()
                spec.stats.committed += 1
            elif not bucket.stepped:
                step_now(opt, bucket, scale)
            upload_final(opt, bucket)
        commit(opt, buckets)
    spec.end_step(norm, skipped=skipped, clipped=clipped)
    spec.stats.seconds_validating += time.perf_counter() - start
    if log.isEnabledFor(logging.DEBUG):   # TORCH_LOGS=+socompile shows one line per step
        log.debug("socompile step %d: norm %.4g, %s; speculation so far %s", spec.stats.steps, norm,
                  "skipped" if skipped else "clipped" if clipped else "committed",
                  spec.stats.as_dict())
    return StepOutcome(norm, skipped, clipped)


def roll_back(opt: "AdamW", bucket: FlatBucket) -> None:
    """Undo ``bucket``'s speculated step."""
    if bucket.speculated == "inplace":
        rollback_inplace(bucket, opt.param_groups, grad_scale=1.0)
    # "spare": the current state was never written; dropping the spare is the rollback.
    bucket.speculated_into(None)
    opt.speculator.stats.rolled_back += 1
    opt.events.record("rollback", bucket.index)


def commit(opt: "AdamW", buckets: list[FlatBucket], has_grad: list[list[bool]] | None = None) -> None:
    """The steps are final: count them and show the current moments in ``opt.state`` (torch's layout).
    ``has_grad``: per bucket, which parameters were stepped (default: the buckets' own)."""
    for k, bucket in enumerate(buckets):
        stepped = bucket.has_grad if has_grad is None else has_grad[k]
        for i, p in enumerate(bucket.params):
            if not stepped[i]:
                continue
            bucket.steps[i] += 1
            state = opt.state_without_waiting()[p]   # called while ending one bucket: not a wait for all
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
            alias_state(bucket, i, state)   # the current copy (a ping-pong commit may have swapped it)
            state["step"].fill_(float(bucket.steps[i]))
    opt.events.record("commit")


def discard_iteration(opt: "AdamW", bucket: FlatBucket) -> None:
    """``zero_grad()`` without ``step()``: undo whatever the backward started on ``bucket``."""
    bucket.wait_grads()
    if bucket.speculated:
        roll_back(opt, bucket)
    elif bucket.stepped:   # taken final during backward (no validation), kept undoable there
        if bucket.rollback_mode == "pingpong":
            bucket.swap_in_spare()   # the spare holds the state before the step, whole
        else:
            rollback_inplace(bucket, opt.param_groups, grad_scale=1.0)
        opt.events.record("rollback", bucket.index)
    bucket.reset_iteration()


def undo_for_script_gradients(opt: "AdamW", buckets: list[FlatBucket]) -> None:
    """The training script changed these buckets' gradients between ``backward()`` and ``step()`` (its own
    ``clip_grad_norm_``, ``clip_grad_value_``, ``GradScaler.unscale_``, a manual ``mul_``). What backward
    stepped or speculated from the gradients as they were is undone here, exactly (the ping-pong spare), and
    ``step()`` then steps from the gradients as the script left them: the same parameters as torch's AdamW after
    the same call. An in-place step (``rollback="inverse"``) cannot be undone once its gradients changed (the
    inverse needs them), so that case is refused before anything else is touched."""
    for bucket in buckets:
        inplace = bucket.speculated == "inplace" or (bucket.stepped and bucket.rollback_mode != "pingpong")
        if inplace:
            raise RuntimeError(
                f"socompile.AdamW.step(): the training script changed the gradients of bucket {bucket.index} "
                f"between backward() and step() (e.g. torch.nn.utils.clip_grad_norm_), after backward had stepped "
                f"that bucket in place (rollback='inverse'), whose undo needs the gradients it stepped with. Pass "
                f"max_grad_norm=... to socompile.AdamW and drop the script's clip, or use rollback='pingpong'.")
    if opt.sharding_active():
        raise RuntimeError(
            "socompile.AdamW.step(): the training script changed the gradients between backward() and step() "
            "(e.g. torch.nn.utils.clip_grad_norm_), but under ZeRO each rank holds only its shard of the reduced "
            "gradients. Pass max_grad_norm=... to socompile.AdamW (it clips over the global norm) and drop the "
            "script's clip.")
    if opt.max_grad_norm is not None and opt.first_script_clip():
        warnings.warn(
            f"socompile.AdamW: the training script changed the gradients between backward() and step() (its own "
            f"clip_grad_norm_ or similar). They are used as the script left them, and the optimizer's "
            f"max_grad_norm={opt.max_grad_norm} is not applied on top: clipping happens once, the script's. Keep "
            f"one of the two; with max_grad_norm alone, clipping is known while backward steps the buckets and "
            f"no bucket is stepped twice.", stacklevel=3)
    for bucket in buckets:
        bucket.wait_grads()
        if bucket.speculated:
            roll_back(opt, bucket)
        elif bucket.stepped:
            bucket.swap_in_spare()   # the spare holds the state before backward's step, whole
            bucket.stepped_final(False)
            opt.events.record("rollback", bucket.index)
        bucket.take_script_gradients()
        bucket.learn_partial(None)   # the norm partial is taken again, of the script's gradients
    opt.events.record("script_gradients")


def step_now(opt: "AdamW", bucket: FlatBucket, grad_scale: float) -> None:
    """Step ``bucket`` now, final (no speculation: validated already, or nothing to validate)."""
    opt.events.record("step_start", bucket.index)
    step_bucket(bucket, opt.param_groups, grad_scale)
    bucket.stepped_final()
    opt.events.record("step_end", bucket.index)


def upload_final(opt: "AdamW", bucket: FlatBucket) -> None:
    """Separate host master: upload ``bucket`` as soon as its step is final (committed, redone, stepped
    now, rolled back by the inverse), so its copy overlaps the rest of ``step()`` and the next forward.
    ZeRO: not yet; only this rank's window is new until the all-gather (``upload_buckets`` after it)."""
    if bucket.dirty and opt.sharding is None:
        opt.upload_bucket(bucket)
