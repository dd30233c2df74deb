"""Speculation-then-validation: the bookkeeping of one optimizer step.

Each CPU bucket's step may start as its gradients arrive, before the global gradient norm (for clipping)
and the non-finite check are known. The running sum of squared gradients only grows as buckets arrive, so
once ``sqrt(sum) + 1e-6`` passes ``max_grad_norm`` clipping is certain and the remaining buckets are not
speculated (a non-finite partial likewise means the step will be skipped). Optionally, recent norms near the
threshold predict clipping and hold speculation for the whole step.
"""
from __future__ import annotations

import collections
import dataclasses
import math

# torch.nn.utils.clip_grad_norm_ divides max_norm by (norm + 1e-6); clipping happens iff that is below 1.
CLIP_EPS = 1e-6


@dataclasses.dataclass
class SpeculationStats:
    steps: int = 0                # every step(), validated or not
    skipped_steps: int = 0        # non-finite gradients: nothing changed
    clipped_steps: int = 0
    speculated: int = 0           # bucket steps started before validation
    committed: int = 0            # speculative bucket steps kept
    rolled_back: int = 0          # speculative bucket steps undone
    redone: int = 0               # rolled back and stepped again with clipped gradients
    held: int = 0                 # CPU buckets not speculated because clipping was certain or predicted
    script_changed_steps: int = 0  # steps whose gradients the training script changed after backward (redone)
    seconds_speculating: float = 0.0
    seconds_validating: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def clip_coefficient(norm: float, max_norm: float | None) -> float:
    """The factor torch's clip_grad_norm_ applies (clamped to 1)."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (norm + CLIP_EPS))


class Speculator:
    """Decides, bucket by bucket within one step, whether a speculative step is still worth starting.
    Called from the single CPU worker thread only (no locking needed)."""

    def __init__(self, max_grad_norm: float | None, predict: bool = True, history: int = 4,
                 near: float = 0.9):
        self.max_grad_norm = max_grad_norm
        self.predict = predict
        self.near = near
        self.recent_norms: collections.deque[float] = collections.deque(maxlen=history)
        self.stats = SpeculationStats()
        self.begin_step()

    def begin_step(self) -> None:
        self.partial_sumsq = 0.0
        self.nonfinite = False
        self.clipping_certain = False
        self.hold_predicted = self._predict_clipping()

    def _predict_clipping(self) -> bool:
        if not self.predict or self.max_grad_norm is None or not self.recent_norms:
            return False
        threshold = self.near * self.max_grad_norm
        return sum(n > threshold for n in self.recent_norms) * 2 > len(self.recent_norms)

    def may_speculate(self) -> bool:
        return not (self.nonfinite or self.clipping_certain or self.hold_predicted)

    def add_partial(self, sumsq: float, nonfinite: bool) -> None:
        self.partial_sumsq += sumsq
        self.nonfinite |= nonfinite or not math.isfinite(sumsq)
        if self.max_grad_norm is not None and not self.nonfinite:
            self.clipping_certain = math.sqrt(self.partial_sumsq) + CLIP_EPS > self.max_grad_norm

    def count_held(self) -> None:
        """A bucket's step was held back (clipping is predicted): it is taken once the step is validated."""
        self.stats.held += 1

    def count_speculated(self, seconds: float) -> None:
        """A bucket was stepped speculatively, taking ``seconds`` of the worker."""
        self.stats.speculated += 1
        self.stats.seconds_speculating += seconds

    def count_committed(self) -> None:
        """A bucket's speculative step was kept."""
        self.stats.committed += 1

    def count_rolled_back(self) -> None:
        """A bucket's speculative step was undone."""
        self.stats.rolled_back += 1

    def count_redone(self) -> None:
        """A bucket's speculative step was undone and taken again with the clip coefficient."""
        self.stats.redone += 1

    def count_script_changed(self) -> None:
        """The training script changed this step's gradients after backward: its buckets are stepped again."""
        self.stats.script_changed_steps += 1

    def count_validating(self, seconds: float) -> None:
        """Validation took ``seconds`` of the training thread."""
        self.stats.seconds_validating += seconds

    def count_unvalidated_step(self) -> None:
        """A step with nothing to validate (no max_grad_norm, no skip-on-overflow): counted like any other."""
        self.stats.steps += 1

    def end_step(self, norm: float, skipped: bool, clipped: bool) -> None:
        self.stats.steps += 1
        self.stats.skipped_steps += skipped
        self.stats.clipped_steps += clipped
        if math.isfinite(norm):
            self.recent_norms.append(norm)
