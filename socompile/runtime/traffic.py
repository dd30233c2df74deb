"""Link traffic accounting: the bytes the socompile runtime moves between host and device, per training step.

Every copy site of the runtime books its bytes here when it queues the copy, keyed by

    direction   "d2h" (device -> host) or "h2d" (host -> device)
    dtype       the dtype of the bytes that cross ("bfloat16", "float32", ...)
    purpose     "gradients", "weight upload", "flow fetch", "activation offload", "activation fetch"

A step ends when ``opt.step()`` returns: ``end_step`` keeps that step's counts (``last``) and starts the next.
The plan predicts the same keys and bytes (plan/transfers.py ``per_step_traffic``); tests hold the two equal byte
for byte. Bytes are element counts times element size, alignment padding included (runtime/flat_bucket.py), as
the plan counts them. A copy that stays on one side (a host master shared with fp32 CPU parameters) is none.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from ..dtypes import TORCH_DTYPES
from ..ledger_names import (ACTIVATION_FETCH, ACTIVATION_OFFLOAD, FLOW_FETCH, GRADIENTS,  # noqa: F401
                            WEIGHT_UPLOAD)


_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def dtype_label(dtype: torch.dtype) -> str:
    """The name a plan records for ``dtype`` (``socompile.dtypes``), else torch's own name ("float64")."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


class StepBooks:
    """Counts by key, per training step: of the step in progress (``current``) and of the last finished one
    (``last``). A CPU job books into the step it belongs to (``booking``), even when it runs after that step's
    ``opt.step()`` returned (the optimizer waits for such jobs before it reads ``last``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._books: dict[int, dict] = {0: {}}
        self._booking = threading.local()   # the step a worker thread's job books into
        self.steps = 0

    @property
    def current(self) -> dict:
        with self._lock:
            return dict(self._books.get(self.steps, {}))

    @property
    def last(self) -> dict:
        with self._lock:
            return dict(self._books.get(self.steps - 1, {}))

    def booking(self, step: int, fn: Callable[[], object]) -> object:
        """Run ``fn`` with everything it books counted in step ``step`` (a CPU job of that step)."""
        self._booking.step = step
        try:
            return fn()
        finally:
            del self._booking.step

    def add_count(self, key, amount: int) -> None:
        with self._lock:
            book = self._books.setdefault(getattr(self._booking, "step", self.steps), {})
            book[key] = book.get(key, 0) + int(amount)

    def end_step(self) -> None:
        with self._lock:
            self.steps += 1
            self._books = {k: v for k, v in self._books.items() if k >= self.steps - 1}
            self._books.setdefault(self.steps, {})


class TrafficLedger(StepBooks):
    """Bytes per (direction, dtype, purpose) of the step in progress and of the last finished step."""

    def add(self, direction: str, dtype: torch.dtype, purpose: str, nbytes: int) -> None:
        if nbytes > 0:
            self.add_count((direction, dtype_label(dtype), purpose), nbytes)

    def add_copy(self, direction: str, purpose: str, dst: torch.Tensor) -> None:
        """Book a copy into ``dst``: what crosses is ``dst``'s bytes in ``dst``'s dtype (a d2h copy converts,
        if at all, on the device before it crosses; an h2d copy lands as it crossed)."""
        self.add(direction, dst.dtype, purpose, dst.numel() * dst.element_size())


# What a host thread blocks on (HostBlockLedger kinds).
EVENT_WAIT = "event synchronize"      # a device copy's (or the CPU build's stream's) completion event
WORKER_WAIT = "CPU worker job"        # a bucket's job on the CPU optimizer worker
DEVICE_READ = "device value read"     # float() of a device tensor: the host waits for the device to get there
WORKER_THREAD_PREFIX = "socompile-cpu-optimizer"   # the CPU worker's threads (runtime/worker.py)


class HostBlockLedger(StepBooks):
    """Every place a host thread may block on the device or on the CPU worker, per step: keys (thread, kind,
    site, "calls" | "blocked"), thread "training" or "worker", ``blocked`` counting the calls that found the
    awaited work not yet done (a call on finished work returns at once). ``opt.host_blocks()`` reads it."""

    def wait(self, kind: str, site: str, done: bool, wait: Callable[[], object]) -> object:
        """Book a wait at ``site`` (``done``: the work had finished already) and run ``wait``."""
        thread = "worker" if threading.current_thread().name.startswith(WORKER_THREAD_PREFIX) else "training"
        self.add_count((thread, kind, site, "calls"), 1)
        if not done:
            self.add_count((thread, kind, site, "blocked"), 1)
        return wait()

    def event(self, event, site: str) -> None:
        """``event.synchronize()``, booked at ``site``."""
        self.wait(EVENT_WAIT, site, event.query(), event.synchronize)

    def by_site(self) -> dict[tuple[str, str, str], dict[str, int]]:
        """The last step's {(thread, kind, site): {"calls": n, "blocked": m}}."""
        out: dict[tuple[str, str, str], dict[str, int]] = {}
        for (thread, kind, site, count), n in self.last.items():
            out.setdefault((thread, kind, site), {"calls": 0, "blocked": 0})[count] = n
        return out


class HostWorkLedger(StepBooks):
    """Bytes the host CPU reads and writes per purpose (plan/host_work.py names them and gives the formulas
    each pass books with), per step: keys (purpose, "read") and (purpose, "written")."""

    def add_work(self, purpose: str, read_written: tuple[int, int]) -> None:
        read, written = read_written
        if read:
            self.add_count((purpose, "read"), read)
        if written:
            self.add_count((purpose, "written"), written)

    def by_purpose(self) -> dict[str, tuple[int, int]]:
        """The last step's {purpose: (read, written)}."""
        out: dict[str, tuple[int, int]] = {}
        for (purpose, kind), nbytes in self.last.items():
            r, w = out.get(purpose, (0, 0))
            out[purpose] = (r + nbytes, w) if kind == "read" else (r, w + nbytes)
        return out
