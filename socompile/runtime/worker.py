"""The CPU optimizer worker: one thread that runs bucket steps in the order they are submitted.

On a CPU build this is also the runtime's "stream": a single-thread executor whose futures are the events.
The kernel releases the GIL, so backward (torch's own threads) and the step run at the same time.
"""
from __future__ import annotations

import concurrent.futures
from typing import Callable

from .traffic import WORKER_WAIT


class CPUWorker:
    def __init__(self, name: str = "socompile-cpu-optimizer"):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        return self._pool.submit(fn)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


class BucketJobs:
    """The worker's jobs of each bucket, in flight: at most one per bucket (the worker runs jobs in the order
    they were submitted). A job may carry a ``then``: work that the training thread runs once the job has
    ended, when somebody first waits for the bucket (``opt.step()`` leaves the end of a step there, so that it
    returns before the step's CPU jobs end; the bucket's first reader in the next forward waits for it)."""

    def __init__(self, blocks=None):
        self._worker: CPUWorker | None = None
        self.blocks = blocks   # runtime/traffic.py HostBlockLedger: each wait booked with its site
        self._jobs: dict[int, tuple[object, concurrent.futures.Future, Callable[[], None] | None]] = {}

    def submit(self, bucket, fn: Callable[[], object]) -> None:
        if id(bucket) in self._jobs:
            raise RuntimeError(f"socompile: bucket {getattr(bucket, 'index', '?')} already has a CPU job in flight")
        if self._worker is None:
            self._worker = CPUWorker()
        self._jobs[id(bucket)] = (bucket, self._worker.submit(fn), None)

    def then(self, bucket, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the training thread after ``bucket``'s job in flight, when the bucket is waited for."""
        held, future, earlier = self._jobs[id(bucket)]
        if earlier is not None:
            raise RuntimeError(f"socompile: bucket {getattr(bucket, 'index', '?')}'s job already has its end")
        self._jobs[id(bucket)] = (held, future, fn)

    def running(self, bucket) -> bool:
        return id(bucket) in self._jobs

    def has_then(self, bucket) -> bool:
        entry = self._jobs.get(id(bucket))
        return entry is not None and entry[2] is not None

    def wait(self, bucket, site: str = "opt.wait_pending") -> bool:
        """Wait for ``bucket``'s job and run its ``then``; True if there was a job. A failed job's error is
        raised here, in the training loop, with a note naming the bucket (its ``then`` is dropped). ``site``:
        who waits (booked in ``blocks``)."""
        entry = self._jobs.pop(id(bucket), None)
        if entry is None:
            return False
        try:
            if self.blocks is not None:
                self.blocks.wait(WORKER_WAIT, site, entry[1].done(), entry[1].result)
            else:
                entry[1].result()
        except Exception as error:   # its own type, as the kernel raised it; the note says where it ran
            if hasattr(error, "add_note"):   # Python 3.11+
                error.add_note(f"(in socompile's CPU optimizer job of bucket {getattr(bucket, 'index', '?')})")
            raise
        if entry[2] is not None:
            entry[2]()
        return True

    def wait_all(self, site: str = "opt.wait_pending") -> None:
        for bucket, _, _ in list(self._jobs.values()):
            self.wait(bucket, site)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
