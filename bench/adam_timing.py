"""Timing of bench/adam.py's methods: round-robin steps, and an optional wait for a quiet machine per round."""
from __future__ import annotations

import dataclasses
import time


def cpu_idle(window=0.25):
    """Fraction of all CPUs' time idle over the next `window` seconds (/proc/stat; None where absent)."""
    def read():
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        return vals[3] + vals[4], sum(vals[:8])  # idle + iowait, total (without guest columns)
    try:
        i0, t0 = read()
        time.sleep(window)
        i1, t1 = read()
    except OSError:
        return None
    return (i1 - i0) / max(t1 - t0, 1)


@dataclasses.dataclass
class QuietWait:
    """With --quiet-wait S (``max_wait``): before a round, wait up to S seconds for the CPUs to be >= 85% idle
    (other processes' work shows up there; their memory traffic does). Counts the rounds that started quiet."""
    max_wait: float = 0.0
    idle: float = 0.85
    rounds: int = 0
    quiet_rounds: int = 0

    def wait(self) -> None:
        if self.max_wait <= 0:
            return
        end = time.monotonic() + self.max_wait
        while True:
            idle = cpu_idle()
            if idle is None or idle >= self.idle:
                self.quiet_rounds += 1
                break
            if time.monotonic() >= end:
                break
        self.rounds += 1


def measure(pr, methods, warmup, repeats, quiet: QuietWait | None = None):
    """Methods interleaved round-robin, one step each per round, so load from other processes on the
    machine falls on all of them alike (``quiet``: wait for a quiet machine before each round). Returns
    {name: [seconds per step]}."""
    quiet = quiet or QuietWait()
    fns = {}
    for name, make in methods:
        fn = make(pr)
        if fn is None:  # not applicable to this configuration
            continue
        fns[name] = fn
        for _ in range(warmup):
            fns[name]()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        quiet.wait()
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times
