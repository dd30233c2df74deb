"""A bucket of parameters laid out flat: one contiguous fp32 buffer each for weights, gradients, exp_avg
and exp_avg_sq, so the CPU kernel steps a whole bucket in one call.

NOTE: parameters alias the bucket. Each fp32 parameter's ``.data`` is re-pointed to its segment of
``master``: the optimizer updates the model's weights in place with no copy-back, and the backward graph's
step node must therefore run after the last backward read of those weights (the planner's ``ready_after``).
Segments start at multiples of ALIGN elements so compiled kernels see aligned inputs; the padding is zero in
every buffer and stays zero under the update (zero gradient, zero moments -> zero step).

NOTE: ping-pong state. For exact, free rollback a bucket keeps a second ("spare") copy of master weights and
moments. A speculative step reads the current copy and writes the spare; commit swaps the two (re-pointing
the parameters to the new weights); rollback does nothing. ``rollback_mode = "inverse"`` keeps one copy and
undoes a speculative step with the kernel's algebraic inverse (not bitwise; for memory-tight plans).
"""
from __future__ import annotations

import torch
from torch import nn

ALIGN = 16  # elements: 64 bytes, a cache line and an AVX-512 vector


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


class FlatBucket:
    def __init__(self, index: int, params: list[nn.Parameter]):
        for p in params:
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise TypeError(f"socompile optimizer buckets hold fp32 CPU parameters for now; got a "
                                f"{p.dtype} parameter on {p.device}. Keep master weights in fp32 (model.float()).")
        self.index = index
        self.params = list(params)
        self.offsets, self.sizes = [], []
        total = 0
        for p in params:
            self.offsets.append(total)
            self.sizes.append(p.numel())
            total += _round_up(p.numel(), ALIGN)
        self.numel = total
        self.master = torch.zeros(total)
        self.grad = torch.zeros(total)
        self.exp_avg = torch.zeros(total)
        self.exp_avg_sq = torch.zeros(total)
        self.steps = [0] * len(params)
        self.has_grad = [False] * len(params)
        self.arrivals = 0          # backward passes that delivered this bucket's gradients since the last step
        self.pending = None        # Future of the worker's task for this bucket (stats, maybe a speculative step)
        self.stepped = False       # stepped in this iteration, finally (no validation pending)
        self.speculated = None     # None, or where the speculative step wrote: "spare" or "inplace"
        self.partial = None        # (sum of squared gradients, any non-finite) of this iteration, once known
        self.rollback_mode = "pingpong"
        self.spare = None          # (master, exp_avg, exp_avg_sq) of the ping-pong spare, allocated on first use
        self.window = None         # ZeRO: (lo, hi) elements this rank steps; None: the whole bucket

    def segment(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i] + self.sizes[i])

    def view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        return buffer[self.segment(i)].view(self.params[i].shape)

    def adopt(self, previous: dict[int, tuple["FlatBucket", int]]) -> None:
        """Fill this bucket from the parameters (or from the bucket that held them before) and re-point
        each parameter's storage into ``master``."""
        for i, p in enumerate(self.params):
            old = previous.get(id(p))
            seg = self.segment(i)
            if old is not None:
                bucket, j = old
                src = bucket.segment(j)
                self.master[seg].copy_(bucket.master[src])
                self.grad[seg].copy_(bucket.grad[src])
                self.exp_avg[seg].copy_(bucket.exp_avg[src])
                self.exp_avg_sq[seg].copy_(bucket.exp_avg_sq[src])
                self.steps[i], self.has_grad[i] = bucket.steps[j], bucket.has_grad[j]
            else:
                self.master[seg].copy_(p.detach().reshape(-1))
            p.data = self.view(self.master, i)
            if p.grad is not None:  # keep a pending gradient, now as a view of this bucket
                self.view(self.grad, i).copy_(p.grad)
                p.grad = self.view(self.grad, i)

    def receive(self, i: int, grad: torch.Tensor, accumulate: bool) -> None:
        """Store a gradient for parameter i (copy, or add when accumulating micro-batches)."""
        dst = self.grad[self.segment(i)]
        if accumulate and self.has_grad[i]:
            dst.add_(grad.reshape(-1))
        else:
            dst.copy_(grad.reshape(-1))
        self.has_grad[i] = True

    def gather_eager_grads(self) -> None:
        """Take gradients that autograd left in ``.grad`` (eager use, or parts of a model not compiled)."""
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            view = self.view(self.grad, i)
            if g.data_ptr() != view.data_ptr():
                view.copy_(g)
                p.grad = view
            self.has_grad[i] = True

    def runs(self, group_of: list[int]) -> list[tuple[int, int, int, int]]:
        """(start, end, group index, step) for maximal runs of consecutive segments that have a gradient
        and share param group and step count: each run is one kernel call."""
        out: list[tuple[int, int, int, int]] = []
        for i in range(len(self.params)):
            if not self.has_grad[i]:
                continue
            key = (group_of[i], self.steps[i] + 1)
            start, end = self.offsets[i], self.offsets[i] + self.sizes[i]
            if out and out[-1][2:] == key and self._contiguous(out[-1][1], i):
                out[-1] = (out[-1][0], end, *key)
            else:
                out.append((start, end, *key))
        if self.window is not None:   # a data-parallel rank steps (and measures) only its shard
            lo, hi = self.window
            out = [(max(s, lo), min(e, hi), *rest) for s, e, *rest in out if min(e, hi) > max(s, lo)]
        return out

    def _contiguous(self, prev_end: int, i: int) -> bool:
        # Padding between segments is zero in all buffers, so a run may cover it.
        return i > 0 and self.has_grad[i - 1] and _round_up(prev_end, ALIGN) == self.offsets[i]

    def spare_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.spare is None:
            self.spare = (torch.zeros_like(self.master), torch.zeros_like(self.exp_avg),
                          torch.zeros_like(self.exp_avg_sq))
        return self.spare

    def swap_in_spare(self) -> None:
        """Commit a ping-pong step: the spare becomes current. Segments the step did not write (no gradient)
        are copied across first, so the new current copy is complete."""
        spare_master, spare_m, spare_v = self.spare
        for i, present in enumerate(self.has_grad):
            if not present:
                seg = self.segment(i)
                spare_master[seg].copy_(self.master[seg])
                spare_m[seg].copy_(self.exp_avg[seg])
                spare_v[seg].copy_(self.exp_avg_sq[seg])
        self.spare = (self.master, self.exp_avg, self.exp_avg_sq)
        self.master, self.exp_avg, self.exp_avg_sq = spare_master, spare_m, spare_v
        for i, p in enumerate(self.params):
            p.data = self.view(self.master, i)

    def reset_iteration(self) -> None:
        self.arrivals = 0
        self.stepped = False
        self.speculated = None
        self.partial = None
