"""A bounded log of runtime events (what started and ended when), for tests, reports and timelines."""
from __future__ import annotations

import collections
import dataclasses
import threading
import time


@dataclasses.dataclass(frozen=True)
class Event:
    t_ns: int
    kind: str        # e.g. "grads_ready", "step_start", "step_end", "validate", "commit"
    bucket: int = -1
    thread: str = ""


class EventLog:
    def __init__(self, capacity: int = 100_000):
        self._events: collections.deque[Event] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.enabled = True

    def record(self, kind: str, bucket: int = -1) -> None:
        if self.enabled:
            event = Event(time.perf_counter_ns(), kind, bucket, threading.current_thread().name)
            with self._lock:
                self._events.append(event)

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()

    def first(self, kind: str, bucket: int) -> Event:
        return next(e for e in self.events() if e.kind == kind and e.bucket == bucket)
