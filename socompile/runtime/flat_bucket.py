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

NOTE: ZeRO shards. ``shard(rank, world)`` gives the bucket a window [lo, hi) of elements this rank steps, and
from then on the optimizer state (exp_avg, exp_avg_sq and the spare's master/moments) covers only the window:
element k of the bucket is element ``k - state_lo`` of those buffers (``local(start, end)``). ``master`` and
``grad`` stay full size: the model's weights alias ``master``, and backward writes whole gradients, which the
reduce-scatter reads. With one rank (or never sharded) the state is the whole bucket and nothing changes.
"""
from __future__ import annotations

import torch
from torch import nn

ALIGN = 16  # elements: 64 bytes, a cache line and an AVX-512 vector


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def shard_window(numel: int, rank: int, world: int) -> tuple[int, int]:
    """Elements [lo, hi) of a bucket of ``numel`` that ``rank`` of ``world`` owns: equal chunks of
    ceil(numel / world) (the reduce-scatter pads the bucket to world chunks); the last ones may be short or empty."""
    chunk = -(-numel // world)
    lo = min(rank * chunk, numel)
    return lo, min(lo + chunk, numel)


class FlatBucket:
    def __init__(self, index: int, params: list[nn.Parameter], shard: tuple[int, int] | None = None):
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
        self.window = None         # ZeRO: (lo, hi) elements this rank steps; None: the whole bucket
        self.state_lo = 0          # bucket element at which exp_avg / exp_avg_sq / the spare start
        state = total
        if shard is not None and shard[1] > 1:
            self.window = shard_window(total, *shard)
            self.state_lo, state = self.window[0], self.window[1] - self.window[0]
        self.exp_avg = torch.zeros(state)
        self.exp_avg_sq = torch.zeros(state)
        self.steps = [0] * len(params)
        self.has_grad = [False] * len(params)
        self.arrivals = 0          # backward passes that delivered this bucket's gradients since the last step
        self.pending = None        # Future of the worker's task for this bucket (stats, maybe a speculative step)
        self.stepped = False       # stepped in this iteration, finally (no validation pending)
        self.speculated = None     # None, or where the speculative step wrote: "spare" or "inplace"
        self.partial = None        # (sum of squared gradients, any non-finite) of this iteration, once known
        self.rollback_mode = "pingpong"
        self.spare = None          # (master, exp_avg, exp_avg_sq) of the ping-pong spare, allocated on first use
        self._views: dict[tuple[int, int], torch.Tensor] = {}

    def segment(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i] + self.sizes[i])

    def view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's segment of ``buffer`` in the parameter's shape. Views are cached per buffer: the
        step path asks for the same ones every iteration (grads, moments, weights after a ping-pong swap), and
        making a view costs microseconds per parameter. Only the bucket's own buffers are cached (two ping-pong
        sets at most); a cached view keeps its buffer alive, so the address in the key cannot be reused."""
        own = (self.master, self.grad, self.exp_avg, self.exp_avg_sq, *(self.spare or ()))
        if not any(buffer is b for b in own):
            return buffer[self.segment(i)].view(self.params[i].shape)
        key = (buffer.data_ptr(), i)
        cached = self._views.get(key)
        if cached is None:
            cached = self._views[key] = buffer[self.segment(i)].view(self.params[i].shape)
        return cached

    @property
    def sharded(self) -> bool:
        """True when this rank keeps optimizer state for its window only (ZeRO with more than one rank)."""
        return self.exp_avg.numel() != self.numel

    def local(self, start: int, end: int) -> slice:
        """Bucket elements [start, end) (inside the state range) as a slice of the state buffers."""
        return slice(start - self.state_lo, end - self.state_lo)

    def held(self, i: int) -> tuple[int, int] | None:
        """Elements [a, b) of parameter i (flattened) whose optimizer state this bucket holds; None if none."""
        lo, hi = self.state_lo, self.state_lo + self.exp_avg.numel()
        start, end = max(self.offsets[i], lo), min(self.offsets[i] + self.sizes[i], hi)
        return (start - self.offsets[i], end - self.offsets[i]) if end > start else None

    def state_part(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """The part of a state buffer (exp_avg, exp_avg_sq, or a spare) that holds parameter i's ``held(i)``
        elements, flat; the whole parameter, shaped like it, when the bucket is not sharded."""
        if not self.sharded:
            return self.view(buffer, i)
        a, b = self.held(i) or (0, 0)
        start = self.offsets[i] + a
        return buffer[self.local(start, start + b - a)]

    def shard(self, rank: int, world: int) -> None:
        """Give this rank the window ``shard_window`` of the bucket and keep optimizer state for it only (the
        window's part of the current state is kept; the ping-pong spare is dropped, it is re-made on use)."""
        if self.window is not None or world <= 1:
            self.window = self.window or (0, self.numel)
            return
        lo, hi = self.window = shard_window(self.numel, rank, world)
        self.exp_avg, self.exp_avg_sq = self.exp_avg[lo:hi].clone(), self.exp_avg_sq[lo:hi].clone()
        self.state_lo, self.spare = lo, None

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
                self._adopt_state(i, bucket, j)
                self.steps[i], self.has_grad[i] = bucket.steps[j], bucket.has_grad[j]
            else:
                self.master[seg].copy_(p.detach().reshape(-1))
            p.data = self.view(self.master, i)
            if p.grad is not None:  # keep a pending gradient, now as a view of this bucket
                self.view(self.grad, i).copy_(p.grad)
                p.grad = self.view(self.grad, i)

    def _adopt_state(self, i: int, bucket: "FlatBucket", j: int) -> None:
        if not self.sharded and not bucket.sharded:
            self.exp_avg[self.segment(i)].copy_(bucket.exp_avg[bucket.segment(j)])
            self.exp_avg_sq[self.segment(i)].copy_(bucket.exp_avg_sq[bucket.segment(j)])
            return
        want, have = self.held(i), bucket.held(j)
        if want is None:
            return
        if have is None or have[0] > want[0] or have[1] < want[1]:
            if bucket.steps[j] == 0:   # no state yet: zeros are right
                return
            raise RuntimeError("socompile: a sharded optimizer's state must be moved between ranks before its "
                               "buckets are laid out again (ZeroSharding.unshard_state); this is a bug")
        for mine, theirs in ((self.exp_avg, bucket.exp_avg), (self.exp_avg_sq, bucket.exp_avg_sq)):
            src = bucket.state_part(theirs, j).reshape(-1)[want[0] - have[0]:want[1] - have[0]]
            self.state_part(mine, i).reshape(-1).copy_(src)

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
        """Spare (master, exp_avg, exp_avg_sq), indexed like the state buffers (``local``): when sharded the
        spare master covers the window only."""
        if self.spare is None:
            self.spare = (torch.zeros_like(self.exp_avg) if self.sharded else torch.zeros_like(self.master),
                          torch.zeros_like(self.exp_avg), torch.zeros_like(self.exp_avg_sq))
        return self.spare

    def swap_in_spare(self) -> None:
        """Commit a ping-pong step: the spare becomes current. Segments the step did not write (no gradient)
        are copied across first, so the new current copy is complete. Sharded: the moments swap, the window of
        the weights is copied from the spare into ``master`` (which the model aliases, and the all-gather fills)."""
        if self.sharded:
            spare_master, spare_m, spare_v = self.spare
            window = self.master[self.window[0]:self.window[1]]
            for i, present in enumerate(self.has_grad):
                if not present and self.held(i) is not None:
                    for mine, spare in ((window, spare_master), (self.exp_avg, spare_m), (self.exp_avg_sq, spare_v)):
                        self.state_part(spare, i).copy_(self.state_part(mine, i))
            window.copy_(spare_master)
            self.spare = (spare_master, self.exp_avg, self.exp_avg_sq)
            self.exp_avg, self.exp_avg_sq = spare_m, spare_v
            return
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
