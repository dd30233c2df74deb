"""Rounded Adam moments in torch ops: the seeds and bits of the CPU kernel's stochastic rounding, bf16 rounding
with them, and int8 blocks: the reference the CPU kernel reproduces bit for bit, the conversions to and from
torch's fp32 layout (state_dict, load), and what a device-stepped bucket's torch step rounds with
(runtime/device_adam.py). The format is socompile/moment_format.py's; the rules of one int8 block:

    decode   m_i = code_i (int8) * scale_m            w_i = code_i (uint8) * scale_v,  v_i = w_i * w_i
    encode   scale_m = max|m_i| / 127                 scale_v = max w_i / 255 with w_i = sqrt(v_i)
             code_i = sign(m_i) * trunc(min(|m_i| * ((1 / max|m_i|) * 127), 127) + u_i)
             code_i = trunc(min(w_i * ((1 / max w_i) * 255), 255) + u'_i), at least 1 where v_i > 0

with u_i, u'_i uniform in [0, 1) from the same hash as the bf16 moments' stochastic rounding (low and high 16
bits of socx_round_bits(seed, i)), so each stored moment equals its fp32 value in expectation. A scale of a
block whose max is 0 is 0 (its codes are 0), and a max that is NaN makes the scale NaN: a non-finite moment
decodes non-finite, as torch's would be. exp_avg_sq is stored as its square root: linear codes on sqrt(v) keep
twice the dynamic range (in orders of magnitude) of linear codes on v, and a v > 0 never decodes to 0, which
would divide the update by eps alone.
"""
from __future__ import annotations

import torch

from ..moment_format import QBLOCK, QBLOCK_BYTES

_M32 = 0xFFFFFFFF


def round_seed(bucket_index: int, step: int, start: int) -> int:
    """The seed of a run's stochastic rounding of bf16 or int8 moments. The kernel draws element i's bits from
    hash(seed + i * 0x9E3779B9); adding ``start`` steps of that stride makes them a function of (bucket, step,
    bucket element) alone, so a bucket cut into other runs (a ZeRO window, a parameter without a gradient)
    rounds each element alike. A step redone after a clip draws the same bits: its rounding is repeatable."""
    base = (step * 0x85EBCA77 + bucket_index * 0xC2B2AE3D) & 0xFFFFFFFF
    return (base + start * 0x9E3779B9) & 0xFFFFFFFF


def round_bits(seed: int, start: int, n: int, device=None) -> torch.Tensor:
    """socx_round_bits(seed, i) for i in [start, start + n), as int64 holding uint32 values, on ``device``."""
    x = (seed + torch.arange(start, start + n, dtype=torch.int64, device=device) * 0x9E3779B9) & _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32   # wraps past 2**63 in int64; the low 32 bits are still the product's
    x ^= x >> 16
    return x


def _blocks(buffer: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [blocks, QBLOCK] uint8, scales [blocks] fp32) of a packed buffer of n elements (views)."""
    blocks = -(-n // QBLOCK)
    if buffer.dtype != torch.uint8 or buffer.numel() != blocks * QBLOCK_BYTES:
        raise ValueError(f"an int8 moment buffer of {n} elements is {blocks * QBLOCK_BYTES} uint8 bytes, got "
                         f"{buffer.numel()} {buffer.dtype}")
    rows = buffer.view(blocks, QBLOCK_BYTES)
    return rows[:, :QBLOCK], rows[:, QBLOCK:].contiguous().view(torch.float32).view(blocks)


def decode(buffer: torch.Tensor, n: int, signed: bool) -> torch.Tensor:
    """The fp32 values of a packed moment buffer of n elements (exp_avg: signed; exp_avg_sq: unsigned, squared)."""
    codes, scales = _blocks(buffer, n)
    q = (codes.view(torch.int8) if signed else codes).float()
    w = (q * scales[:, None]).reshape(-1)[:n]
    return w if signed else w * w


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """fp32 square root correctly rounded, as C's sqrtf (the kernel's, also its step's denominator): torch's
    vectorised fp32 sqrt is 1 ulp off for some inputs on some CPUs. The double root of an fp32 value rounded to
    fp32 is the correctly rounded fp32 root (double holds more than twice fp32's precision)."""
    return torch.sqrt(x.double()).float()


def _padded(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    blocks = -(-n // QBLOCK)
    out = torch.zeros(blocks * QBLOCK, dtype=torch.float32, device=x.device)
    out[:n] = x.reshape(-1)
    return out.view(blocks, QBLOCK)


def _nan_max(x: torch.Tensor) -> torch.Tensor:
    """Max of each block, NaN where a block has a NaN (torch.amax propagates NaN)."""
    return x.amax(dim=1)


def encode(values: torch.Tensor, signed: bool, bits: torch.Tensor) -> torch.Tensor:
    """Pack fp32 ``values`` (exp_avg if signed, else exp_avg_sq) with random ``bits`` (round_bits of the same
    elements; exp_avg uses their low 16 bits, exp_avg_sq their high 16) into a new uint8 buffer."""
    n = values.numel()
    x = _padded(values.float())
    u = _padded(((bits & 0xFFFF) if signed else (bits >> 16)).float() * (1.0 / 65536.0))
    top = 127.0 if signed else 255.0
    mag = x.abs() if signed else _sqrt(x)
    peak = _nan_max(mag)
    scale = peak / top
    # (1 / peak) * top, two roundings, as the kernel computes it (one reciprocal per block, then a multiply)
    inv = torch.where(peak > 0, peak.reciprocal() * top, torch.zeros_like(peak))
    y = mag * inv[:, None]
    y = torch.where(y < top, y, torch.full_like(y, top))   # NaN -> top, as the kernel's compare-select
    q = (y + u).to(torch.int32)                            # y + u >= 0: truncation is floor
    if signed:
        q = torch.where(x < 0, -q, q)
        codes = q.to(torch.int8).view(torch.uint8)
    else:
        q = torch.where((q == 0) & (x > 0), torch.ones_like(q), q)
        codes = q.to(torch.uint8)
    blocks = x.shape[0]
    out = torch.empty(blocks, QBLOCK_BYTES, dtype=torch.uint8, device=x.device)
    out[:, :QBLOCK] = codes
    out[:, QBLOCK:] = scale.contiguous().view(torch.uint8).view(blocks, 4)
    flat = out.view(-1)
    if n % QBLOCK:   # codes past n are 0, as the kernel leaves a short block's
        flat.view(blocks, QBLOCK_BYTES)[-1, n % QBLOCK:QBLOCK] = 0
    return flat


def encode_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, seed: int, start: int = 0):
    """Both moments of elements [start, start + n) packed, with the bits the kernel draws for round_seed ``seed``
    at call index ``start``."""
    bits = round_bits(seed, start, exp_avg.numel(), exp_avg.device)
    return encode(exp_avg, True, bits), encode(exp_avg_sq, False, bits)


def as_fp32(moment_format: str, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
            n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 values of ``n`` elements' moments stored in ``moment_format``: int8 blocks decoded (flat), bf16
    upcast (new tensors), fp32 or float64 the tensors themselves."""
    if moment_format == "int8":
        return decode(exp_avg, n, signed=True), decode(exp_avg_sq, n, signed=False)
    return (exp_avg.float(), exp_avg_sq.float()) if exp_avg.dtype == torch.bfloat16 else (exp_avg, exp_avg_sq)


def stochastic_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 as the kernel's bf16 moments are (socx_f32_to_bf16_sr): the low 16 bits of
    ``bits`` added below the kept bits, then truncated; NaN stays NaN (0xFFFF)."""
    u = x.float().contiguous().view(torch.int32).to(torch.int64) & _M32
    t = ((u + (bits & 0xFFFF)) >> 16) & 0xFFFF
    t = torch.where(torch.isnan(x), torch.full_like(t, 0xFFFF), t)
    return (t - (t >= 0x8000).to(torch.int64) * 0x10000).to(torch.int16).view(torch.bfloat16)
