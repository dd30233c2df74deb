"""The CPU optimizer worker: one thread that runs bucket steps in the order they are submitted.

On a CPU build this is also the runtime's "stream": a single-thread executor whose futures are the events.
The kernel releases the GIL, so backward (torch's own threads) and the step run at the same time.
"""
from __future__ import annotations

import concurrent.futures
from typing import Callable


class CPUWorker:
    def __init__(self, name: str = "socompile-cpu-optimizer"):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        return self._pool.submit(fn)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
