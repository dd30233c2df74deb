"""How a bucket's Adam moments are stored, in bytes: the one place the planner, the buffer layout and the
runtime learn a format's size from.

Formats (``socompile.AdamW(moment_dtype=...)``):
    "float32"    torch's: 4 B per element and moment
    "bfloat16"   2 B, stochastically rounded (docs/kernel.md, "bf16 moments")
    "int8"       block-quantised (docs/kernel.md, "int8 moments"): every ``QBLOCK`` elements are stored as
                 ``QBLOCK`` one-byte codes followed by one fp32 scale, ``QBLOCK_BYTES`` bytes in all, in one
                 uint8 buffer; exp_avg's codes are signed (two's complement), exp_avg_sq's unsigned

Why 16-element blocks: a bucket's parameter segments start at multiples of 16 elements (plan/bucketize.py
ALIGN), and so does every run of segments the kernel steps and every kernel thread's block. A block is thus
never shared by two kernel calls or two threads, so a scale is computed from exactly the elements that share
it, however a bucket is cut into runs. Small blocks also keep the scale close to each element (an element far
below its block's largest loses the fewest bits). The price is the scale: 4 B per 16 elements, 0.25 B per
element and moment, so int8 moments cost 2.5 B per parameter instead of fp32's 8.
"""
from __future__ import annotations

from types import MappingProxyType

QBLOCK = 16                   # elements per quantisation block (== plan/bucketize.py ALIGN, see above)
QBLOCK_BYTES = QBLOCK + 4     # their codes, then the block's fp32 scale
MOMENT_FORMATS = ("float32", "bfloat16", "int8")
INT8_BYTES_PER_ELEMENT = QBLOCK_BYTES / QBLOCK   # codes and scale, per element and moment
_DTYPE_BYTES = MappingProxyType({"uint8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8})


def quantised(moment_dtype: str) -> bool:
    return moment_dtype == "int8"


def shard_block(moment_dtype: str) -> int:
    """Elements a ZeRO rank's window must start at a multiple of: int8 blocks are never cut between ranks, so a
    rank steps, saves and gathers whole blocks."""
    return QBLOCK if quantised(moment_dtype) else 1


def moment_buffer(moment_dtype: str, elements: int) -> tuple[str, int]:
    """(torch dtype name, elements) of the buffer holding one moment of ``elements`` parameters."""
    if moment_dtype == "int8":
        return "uint8", -(-elements // QBLOCK) * QBLOCK_BYTES
    return moment_dtype, elements


def moment_bytes_per_element(moment_dtype: str) -> float:
    """Bytes one moment of one parameter takes (and the CPU kernel reads and writes per step)."""
    return INT8_BYTES_PER_ELEMENT if moment_dtype == "int8" else _DTYPE_BYTES[moment_dtype]


def format_of(bytes_per_element: float) -> str:
    """The moment format whose elements take ``bytes_per_element`` (the plan's "moment_bytes" prediction)."""
    for name in MOMENT_FORMATS:
        if moment_bytes_per_element(name) == bytes_per_element:
            return name
    raise ValueError(f"no Adam moment format takes {bytes_per_element} B per element")


def moment_bytes(moment_dtype: str, elements: int) -> int:
    """Bytes of one moment's buffer for ``elements`` parameters."""
    dtype, n = moment_buffer(moment_dtype, elements)
    return n * _DTYPE_BYTES[dtype]


def moments_streamed(moment_bytes: float, elements: float) -> float:
    """Bytes of both moments of a kernel call over ``elements`` (``moment_bytes`` per element and moment): an int8
    call reads and writes whole blocks, so a short last block counts whole."""
    if moment_bytes == INT8_BYTES_PER_ELEMENT:
        return 2 * -(-elements // QBLOCK) * QBLOCK_BYTES
    return 2 * moment_bytes * elements


def byte_range(moment_dtype: str, start: int, end: int) -> tuple[int, int]:
    """Buffer elements holding parameter elements [start, end) of a moment buffer; an int8 range must start at
    a block (the bucket's segments and runs all do)."""
    if moment_dtype != "int8":
        return start, end
    if start % QBLOCK:
        raise RuntimeError(f"socompile: an int8 moment range must start at a multiple of {QBLOCK} elements, got "
                           f"{start}; this is a bug")
    return start // QBLOCK * QBLOCK_BYTES, -(-end // QBLOCK) * QBLOCK_BYTES
