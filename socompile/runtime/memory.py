"""Device-memory accounting: an exact count of the bytes the socompile runtime holds on the device.

The runtime books every device tensor it owns here when it makes it and when it lets it go, by category:

    "stationary weights"     weights of weight-stationary buckets (on the CPU build: the parameters themselves)
    "GPU optimizer state"    fp32 master, gradient, exp_avg, exp_avg_sq of buckets stepped on the device
    "weight-flow buffers"    a flow bucket's fetched weights, from its prefetch to its release

and keeps the current total, the peak (with the breakdown at the peak) and the peak of each phase
("forward", "backward", "optimizer"). Bytes are the tensors' element counts times their element size,
including the alignment padding between parameters (runtime/flat_bucket.py), exactly as the plan predicts them
(plan/memory.py: runtime_device_bytes). Activations and other tensors the compiled graph allocates are not the
runtime's and are not counted here (on CUDA, torch.cuda.max_memory_allocated sees both).
"""
from __future__ import annotations

import itertools
import threading
import weakref

from ..ledger_names import (ACCUMULATION, ACTIVATIONS, HOST_PURPOSES, LANDING, MASTER,  # noqa: F401
                            MOMENTS, SPARES, STAGING)


class DeviceLedger:
    def __init__(self):
        self._lock = threading.Lock()
        self.by_category: dict[str, int] = {}
        self.current = 0
        self.peak = 0
        self.peak_parts: dict[str, int] = {}
        self.phase = "setup"
        self.phase_peak: dict[str, int] = {}
        self.live: dict[tuple[str, object], int] = {}    # (category, key) -> bytes, to catch double frees

    def alloc(self, category: str, key: object, nbytes: int) -> None:
        with self._lock:
            if (category, key) in self.live:
                raise RuntimeError(f"device ledger: {category} {key!r} booked twice without a release")
            self.live[(category, key)] = nbytes
            self.by_category[category] = self.by_category.get(category, 0) + nbytes
            self.current += nbytes
            if self.current > self.peak:
                self.peak = self.current
                self.peak_parts = dict(self.by_category)
            if self.current > self.phase_peak.get(self.phase, 0):
                self.phase_peak[self.phase] = self.current

    def free(self, category: str, key: object) -> int:
        with self._lock:
            nbytes = self.live.pop((category, key), None)
            if nbytes is None:
                raise RuntimeError(f"device ledger: {category} {key!r} released but not held")
            self.by_category[category] -= nbytes
            self.current -= nbytes
            return nbytes

    def holds(self, category: str, key: object) -> bool:
        with self._lock:
            return (category, key) in self.live

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            self.phase_peak[phase] = max(self.phase_peak.get(phase, 0), self.current)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current
            self.peak_parts = dict(self.by_category)
            self.phase_peak = {self.phase: self.current}

    def summary(self) -> dict:
        with self._lock:
            return {"current": self.current, "peak": self.peak, "peak_parts": dict(self.peak_parts),
                    "phase_peak": dict(self.phase_peak), "by_category": dict(self.by_category)}


class HostLedger(DeviceLedger):
    """Host-memory accounting: every host buffer the runtime allocates, booked by purpose (HOST_PURPOSES) and
    as pinned or pageable when it is made, and released when its tensor is garbage (``weakref.finalize``), so a
    buffer dropped anywhere (a ZeRO shard's old moments, a bucket laid out again, an offloaded activation the
    backward consumed) leaves the books without a free call at each site. Categories are (purpose, "pinned" |
    "pageable"). plan/memory.py (host_buffers) predicts the same books; tests compare them byte for byte."""

    def __init__(self):
        super().__init__()
        # Reentrant: a finalizer may run from the garbage collector inside alloc() on the same thread.
        self._lock = threading.RLock()
        self._keys = itertools.count()

    def book(self, purpose: str, tensor, pinned: bool):
        """Book ``tensor`` (a host buffer just allocated) under ``purpose``; returns it."""
        if purpose not in HOST_PURPOSES:
            raise ValueError(f"host ledger: unknown purpose {purpose!r}; one of {HOST_PURPOSES}")
        category, key = (purpose, "pinned" if pinned else "pageable"), next(self._keys)
        self.alloc(category, key, tensor.numel() * tensor.element_size())
        weakref.finalize(tensor, self.free, category, key)
        return tensor

    def host_summary(self) -> dict:
        """{"current", "pinned", "pageable", "peak", "by_purpose": {purpose: {"pinned", "pageable"}},
        "peak_by_purpose": the same at the peak}: bytes, purposes with no bytes left out."""
        with self._lock:
            now, at_peak = dict(self.by_category), dict(self.peak_parts)
            current, peak = self.current, self.peak
        pinned = sum(v for (_, kind), v in now.items() if kind == "pinned")
        return {"current": current, "pinned": pinned, "pageable": current - pinned, "peak": peak,
                "by_purpose": _by_purpose(now), "peak_by_purpose": _by_purpose(at_peak)}


def _by_purpose(by_category: dict) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (purpose, kind), nbytes in sorted(by_category.items()):
        if nbytes:
            out.setdefault(purpose, {"pinned": 0, "pageable": 0})[kind] += nbytes
    return out
