"""Hardware profiles: the machine a plan is made for. Each number cites its source."""
from __future__ import annotations

import dataclasses

GB = 10**9


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    name: str
    device_memory: int            # bytes of GPU memory
    device_bandwidth: float       # bytes/s of GPU memory
    device_bf16_flops: float      # dense bf16 matmul FLOP/s
    host_memory: int              # bytes of CPU memory
    host_bandwidth: float         # bytes/s of CPU memory
    host_cores: int
    link_bandwidth: float         # bytes/s per direction between GPU and CPU
    link_latency: float           # seconds per transfer


PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA GH200 datasheet: 96 GB HBM3 at ~4 TB/s, H100 dense bf16 ~989 TFLOP/s, up to 480 GB LPDDR5X at
    # ~500 GB/s, 72 Neoverse V2 cores, NVLink-C2C 900 GB/s total = 450 GB/s per direction.
    "gh200": HardwareProfile("gh200", 96 * GB, 4.0e12, 989e12, 480 * GB, 500e9, 72, 450e9, 5e-6),
    # GH200 with 144 GB HBM3e at ~4.9 TB/s (same Grace side).
    "gh200-144g": HardwareProfile("gh200-144g", 144 * GB, 4.9e12, 989e12, 480 * GB, 500e9, 72, 450e9, 5e-6),
    # H100 PCIe datasheet: 80 GB HBM2e at 2 TB/s, ~756 TFLOP/s dense bf16; PCIe Gen5 x16 64 GB/s per direction,
    # ~55 achieved. Host: a typical 2-socket server, 1 TB DDR5 at ~300 GB/s, 64 cores.
    "h100-pcie": HardwareProfile("h100-pcie", 80 * GB, 2.0e12, 756e12, 1000 * GB, 300e9, 64, 55e9, 10e-6),
    # A100 PCIe datasheet: 80 GB HBM2e at ~1.9 TB/s, 312 TFLOP/s dense bf16; PCIe Gen4 x16 32 GB/s per
    # direction, ~25 achieved. Host: 2-socket DDR4 server, ~200 GB/s, 64 cores.
    "a100-pcie": HardwareProfile("a100-pcie", 80 * GB, 1.9e12, 312e12, 1000 * GB, 200e9, 64, 25e9, 10e-6),
}


def get_profile(name: str) -> HardwareProfile:
    if name not in PROFILES:
        import difflib
        close = difflib.get_close_matches(name, list(PROFILES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown target {name!r}{hint}; known targets: {', '.join(PROFILES)}")
    return PROFILES[name]
