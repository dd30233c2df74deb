"""Byte-level training text from the Python standard library's own ``.py`` files.

Every machine that runs socompile has them, so the demo trains on real text with no download.
"""
from __future__ import annotations

import pathlib
import sysconfig

import torch


def stdlib_corpus(max_bytes: int = 4_000_000) -> bytes:
    """Concatenate stdlib sources in a fixed (sorted) order, so every machine gets the same text."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no .py files found under {root}; pass your own text to ByteBatches")
    return b"".join(chunks)[:max_bytes]


class ByteBatches:
    """Random (input, target) windows of a byte string, reproducible from a seed."""

    def __init__(self, text: bytes, batch: int, seq: int, seed: int = 0):
        self.tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        if len(self.tokens) <= seq + 1:
            raise ValueError(f"text of {len(self.tokens)} bytes is too short for seq={seq}")
        self.batch, self.seq = batch, seq
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - self.seq - 1, (self.batch,), generator=self.generator)
        window = torch.stack([self.tokens[s:s + self.seq + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]
