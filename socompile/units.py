"""Byte counts as text in the unit that shows them ("8.5 MB", "256.0 KB", "12 B"), for plan messages and
reports alike (decimal units, as the options parse them: "64MB" = 64e6 bytes)."""
from __future__ import annotations

import math

_UNITS = ("B", "KB", "MB", "GB", "TB")


def human_bytes(n: float, round_up: bool = False) -> str:
    """``n`` bytes with one decimal in the largest unit that keeps it >= 1. ``round_up``: never print less
    than ``n`` (for minimums: a budget of the printed size holds what was asked)."""
    i = 0   # the largest unit that keeps the value >= 1 (TB at most)
    while i + 1 < len(_UNITS) and abs(n) >= 1000 ** (i + 1):
        i += 1
    if i == 0:
        return f"{math.ceil(n) if round_up else n:.0f} B"
    scale = 1000 ** i
    value = -(-math.ceil(n) * 10 // scale) / 10 if round_up else n / scale   # integer ceil: no float slop
    return f"{value:.1f} {_UNITS[i]}"
