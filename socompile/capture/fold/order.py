"""The order of a traced sequence (graph nodes or outputs) once block slot 2's items are repeated for every
block that was not traced."""
from __future__ import annotations

from .blocks import FoldError


def _runs(labels: list[int | None]) -> list[tuple[int | None, int, int]]:
    """(label, start, end) of maximal runs of equal labels."""
    runs, start = [], 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            runs.append((labels[start], start, i))
            start = i
    return runs


def expand_order(labels: list[int | None], copies: list[int], what: str) -> list[tuple[int, int | None]]:
    """The order of a sequence once slot 2's items are repeated for ``copies`` (the new blocks' indices):
    (position in the traced sequence, copy or None for the traced item itself). Where slot 2's run is followed
    by slot 3 (or follows slot 1) the copies come after it in increasing order; where the runs go down (the
    backward, and the saved weights at the forward's end) they come before it, the highest first."""
    runs = _runs(labels)
    shape = [(lab, end - start) for lab, start, end in runs if lab in (1, 2)]
    ones = [n for lab, n in shape if lab == 1]
    twos = [n for lab, n in shape if lab == 2]
    if ones != twos:
        raise FoldError(f"{what}: block slots 1 and 2 do not form matching runs ({ones} vs {twos})")
    out: list[tuple[int, int | None]] = []
    for i, (lab, start, end) in enumerate(runs):
        items = range(start, end)
        if lab != 2:
            out += [(j, None) for j in items]
            continue
        before = runs[i - 1][0] if i > 0 else None
        after = runs[i + 1][0] if i + 1 < len(runs) else None
        if before == 1 or after == 3:
            out += [(j, None) for j in items]
            out += [(j, c) for c in copies for j in items]
        elif before == 3 or after == 1:
            out += [(j, c) for c in reversed(copies) for j in items]
            out += [(j, None) for j in items]
        else:
            raise FoldError(f"{what}: cannot place the copies of block slot 2 (neighbours {before}, {after})")
    return out
