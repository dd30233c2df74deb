"""Hardware profiles: the machine a plan is made for. Each number cites its source.

A profile is frozen data. Shipped profiles live in ``PROFILES``; a user profile is a JSON or TOML file with the
same field names (``load_profile``); ``this-machine`` is measured by ``calibrate.py`` and cached in a profile
file. ``targets.get_profile`` accepts a name, ``this-machine`` or a path.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib

from .cpu_adam import adam_kernel_bytes, cpu_adam_bandwidth

GB = 10**9

# NOTE: CPU Adam bytes per parameter (cpu_adam.adam_kernel_bytes). One fused AdamW pass reads p, g, m, v and
# writes p, m, v: 7 fp32 streams = 28 B/param (26 with bf16 gradients; +2 when it also writes the bf16 weight
# copy). calibrate.py turns a measured time into a bandwidth with these.
ADAM_BYTES_FP32_GRAD = int(sum(adam_kernel_bytes(1, 4, False)))
ADAM_BYTES_BF16_GRAD = int(sum(adam_kernel_bytes(1, 2, False)))
ADAM_BYTES_BF16_COPY = int(sum(adam_kernel_bytes(1, 2, True)) - ADAM_BYTES_BF16_GRAD)


@dataclasses.dataclass(frozen=True)
class KernelRate:
    """One kernel class's rate measured on this machine's "device" (calibrate on a CPU-only build), where one
    datasheet figure per profile does not describe it. ``kernel``: "matmul" (FLOP/s of the three products of a
    linear layer's step whose shortest and longest dimensions are ``shape``: a square, or ``tokens`` x
    ``width`` activations times a ``width``-side weight), "attention" or "attention_backward" (FLOP/s at a query of ``shape`` = (tokens, head dim)),
    "elementwise" (bytes/s of a binary elementwise op on cache-resident operands, ``shape`` empty), or
    "elementwise_binary", "elementwise_math", "elementwise_reduction" (elements/s of one family of elementwise
    ops: ``a * b``, ``silu``, a row sum; ``shape`` empty);
    ``dtype``: ``str(torch dtype)``. On a CPU the rates depend on the shape: bf16 attention backward runs at
    ~9 GFLOP/s at 128 x 32 and ~40 at 512 x 128; a bf16 matmul at ~110 GFLOP/s at side 128 and ~190 at 1024."""
    kernel: str
    dtype: str
    rate: float
    shape: tuple[int, ...] = ()

    def __post_init__(self):
        # A matmul measured before matmuls were keyed by (shortest, longest) side has its square's one side.
        if self.kernel == "matmul" and len(self.shape) == 1:
            object.__setattr__(self, "shape", (self.shape[0], self.shape[0]))


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
    cpu_adam_bandwidth: float = 0.0   # bytes/s the CPU Adam kernel streams (0: cpu_adam.py's measured share)
    device_reserved: int = 2 * GB     # bytes of device memory not available to the plan (context, allocator slack)
    link_bandwidth_d2h: float = 0.0   # bytes/s device->host if different from link_bandwidth (0: same)
    source: str = ""                  # where the numbers come from (shown in reports)
    # Between GPUs (data- and sequence-parallel collectives). Bandwidths are per GPU and per direction, as the
    # datasheets' "bidirectional" figures halved; collectives reach NET_EFFICIENCY of them (perf/cost.py).
    gpus_per_node: int = 1            # GPUs that share the intra-node fabric
    gpus_per_host: int = 1            # GPUs that share host_memory/host_cores/CPU Adam (1 on a Superchip)
    intra_node_bandwidth: float = 0.0   # bytes/s per GPU per direction inside a node (NVLink/PCIe)
    inter_node_bandwidth: float = 0.0   # bytes/s per GPU per direction between nodes (InfiniBand NIC share)
    interconnect_latency: float = 10e-6   # seconds per collective step (launch + first byte), across nodes
    device_is_host: bool = False      # no GPU: the "device" is this CPU (calibrate without CUDA; DESIGN section 5)
    device_fp32_flops: float = 0.0    # fp32 matmul FLOP/s where measured (calibrate); 0: the bf16 rate
    device_op_latency: float = 0.0    # seconds each kernel costs beyond its roofline time where it is not hidden
                                      # (a CPU "device": the dispatch runs on the cores; calibrate measures it)
    cpu_bucket_overhead: float = 0.0  # seconds of the runtime's Python work per bucket step beyond the kernel
                                      # (bookkeeping, swap, upload hand-off; calibrate measures it; 0: not charged)
    cpu_grad_overhead: float = 0.0    # seconds of that work per gradient tensor of the bucket (receiving it into
                                      # the flat buffer; calibrate measures it; 0: not charged)
    weight_fetch_overhead: float = 0.0   # seconds of the runtime's Python work per flow fetch (prefetch, wait,
                                      # release) beyond the copy hand-off (calibrate on a CPU; 0: not charged)
    activation_offload_overhead: float = 0.0   # seconds of the runtime's work per offloaded saved tensor, out
                                      # and back (hand-offs, bookkeeping; calibrate on a CPU; 0: not charged)
    device_kernel_rates: tuple[KernelRate, ...] = ()   # measured rates where a FLOP rate and a bandwidth do not
                                      # describe the kernel (calibrate on a CPU; none in the GPU profiles)

    @property
    def adam_bandwidth(self) -> float:
        """Bytes/s of the CPU Adam kernel: measured on the machine (calibrate), or the share of the host's
        memory bandwidth bench/adam.py measured our kernel to stream (cpu_adam.py)."""
        return self.cpu_adam_bandwidth or cpu_adam_bandwidth(self.host_bandwidth)

    def matmul_flops(self, dtype: str = "") -> float:
        """FLOP/s of a matmul computing in ``dtype`` (``str(torch dtype)``): the measured fp32 rate for fp32 where
        the profile has one (on a CPU "device" fp32 runs at about a third of bf16 with AVX512-BF16), else the
        bf16 rate (the shipped GPU profiles: not measured, left as before)."""
        if dtype == "torch.float32" and self.device_fp32_flops:
            return self.device_fp32_flops
        return self.device_bf16_flops

    def kernel_flops(self, kernel: str, dtype: str, shape: tuple[float, ...]) -> float:
        """Measured FLOP/s of ``kernel`` in ``dtype`` at ``shape``, interpolated between the measured shapes
        (log-log linear in each dimension, the nearest measured rate outside their range); 0 where the profile
        has no measurement (GPU profiles: the datasheet rate times the class's efficiency, perf/cost.py)."""
        points = {r.shape: r.rate for r in self.device_kernel_rates
                  if r.kernel == kernel and r.dtype == dtype and r.rate > 0 and len(r.shape) == len(shape)}
        return _interpolate_grid(points, tuple(shape)) if points else 0.0

    def elementwise_slowdown(self, dtype: str) -> float:
        """How much longer than its bytes at ``device_bandwidth`` an elementwise kernel in ``dtype`` takes,
        relative to fp32: fp32's measured elementwise bytes/s over ``dtype``'s (bf16 on a CPU converts every
        element to fp32 and back: more work per byte). 1 where not measured (GPU profiles) and for fp32."""
        rates = {r.dtype: r.rate for r in self.device_kernel_rates if r.kernel == "elementwise" and r.rate > 0}
        if dtype not in rates or "torch.float32" not in rates:
            return 1.0
        return rates["torch.float32"] / rates[dtype]

    def elementwise_rate(self, family: str, dtype: str) -> float | None:
        """Measured elements/s of the elementwise ``family`` ("binary", "math", "reduction") in ``dtype``; None
        where not measured (the GPU profiles: their elementwise kernels are charged their bytes)."""
        for r in self.device_kernel_rates:
            if r.kernel == f"elementwise_{family}" and r.dtype == dtype and r.rate > 0:
                return r.rate
        return None

    @property
    def cpu_adam_params_per_s(self) -> float:
        """Parameters/s of one fp32 AdamW step on the CPU (28 B/param)."""
        return self.adam_bandwidth / ADAM_BYTES_FP32_GRAD

    @property
    def h2d_bandwidth(self) -> float:
        return self.link_bandwidth

    @property
    def d2h_bandwidth(self) -> float:
        return self.link_bandwidth_d2h or self.link_bandwidth

    def group_bandwidth(self, group: int, stride: int = 1) -> float:
        """Bytes/s per GPU per direction for a collective among ``group`` ranks whose ranks are ``stride``
        apart (rank r sits on node r // gpus_per_node): the intra-node fabric when the whole group shares a
        node, else the inter-node NIC share. 0 when the profile does not say."""
        if group <= 1:
            return float("inf")
        span = (group - 1) * stride + 1
        inside = span <= max(1, self.gpus_per_node) and self.gpus_per_node > 1
        return self.intra_node_bandwidth if inside else (self.inter_node_bandwidth or self.intra_node_bandwidth)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA GH200 datasheet: 96 GB HBM3 at ~4 TB/s, H100 dense bf16 ~989 TFLOP/s, up to 480 GB LPDDR5X at
    # ~500 GB/s, 72 Neoverse V2 cores, NVLink-C2C 900 GB/s total = 450 GB/s per direction. CPU Adam: the share
    # of the memory bandwidth our kernel streams, measured by bench/adam.py (cpu_adam.py; the SuperOffload
    # blog's GraceAdam reached 368 GB/s = 74% of it).
    # Between Superchips: one GH200 per node (NVIDIA MGX GH200 servers; the paper's 8-GH200 runs are taken as 8
    # such nodes), one ConnectX-7 NDR InfiniBand NIC per Superchip: 400 Gb/s = 50 GB/s per direction (NVIDIA
    # ConnectX-7 / Quantum-2 NDR datasheets). Inside an NVLink domain (GH200 NVL2 / NVL32) the GPUs talk over
    # fourth-generation NVLink, 900 GB/s bidirectional = 450 GB/s per direction per GPU (NVIDIA GH200 NVL32
    # and Hopper architecture pages): set gpus_per_node (or --nodes) for such a system.
    # NVLink-C2C per direction as measured, not the datasheet's 450 GB/s each way: nvbandwidth on GH200 gives
    # ~411-421 GB/s host-to-device and only ~170 GB/s device-to-host (reported in Megatron-LM issue 6491).
    "gh200": HardwareProfile("gh200", 96 * GB, 4.0e12, 989e12, 480 * GB, 500e9, 72, 415e9, 5e-6,
                             cpu_adam_bandwidth=cpu_adam_bandwidth(500e9), link_bandwidth_d2h=170e9,
                             source="NVIDIA GH200 datasheet; NVLink-C2C per direction measured with nvbandwidth "
                             "(Megatron-LM issue 6491); CPU Adam share measured by bench/adam.py; "
                             "ConnectX-7 NDR 400 Gb/s per Superchip; NVLink 4 900 GB/s per GPU",
                             gpus_per_node=1, intra_node_bandwidth=450e9, inter_node_bandwidth=50e9),
    # GH200 with 144 GB HBM3e at ~4.9 TB/s (same Grace side, same network).
    "gh200-144g": HardwareProfile("gh200-144g", 144 * GB, 4.9e12, 989e12, 480 * GB, 500e9, 72, 415e9, 5e-6,
                                  cpu_adam_bandwidth=cpu_adam_bandwidth(500e9), link_bandwidth_d2h=170e9,
                                  source="NVIDIA GH200 (HBM3e) datasheet; NVLink-C2C per direction measured "
                                  "(nvbandwidth, Megatron-LM issue 6491); ConnectX-7 NDR; CPU Adam share measured",
                                  gpus_per_node=1, intra_node_bandwidth=450e9, inter_node_bandwidth=50e9),
    # H100 PCIe datasheet: 80 GB HBM2e at 2 TB/s, ~756 TFLOP/s dense bf16; PCIe Gen5 x16 64 GB/s per direction,
    # ~55 achieved. Host: a typical 2-socket server, 1 TB DDR5 at ~300 GB/s, 64 cores. CPU Adam: the measured
    # share of the host bandwidth (cpu_adam.py), as on every profile.
    # Between GPUs: 8 per server; H100 PCIe cards pair up with NVLink bridges (600 GB/s bidirectional) but the
    # 8-GPU collective runs at the PCIe Gen5 rate through the host switches: ~55 GB/s per direction. One NDR
    # 400 Gb/s NIC per GPU (a common rail-optimised build) = 50 GB/s per direction.
    "h100-pcie": HardwareProfile("h100-pcie", 80 * GB, 2.0e12, 756e12, 1000 * GB, 300e9, 64, 55e9, 10e-6,
                                 cpu_adam_bandwidth=cpu_adam_bandwidth(300e9),
                                 source="NVIDIA H100 PCIe datasheet; PCIe Gen5; CPU Adam share measured",
                                 gpus_per_node=8, gpus_per_host=8, intra_node_bandwidth=55e9,
                                 inter_node_bandwidth=50e9),
    # A100 PCIe datasheet: 80 GB HBM2e at ~1.9 TB/s, 312 TFLOP/s dense bf16; PCIe Gen4 x16 32 GB/s per
    # direction, ~25 achieved. Host: 2-socket DDR4 server, ~200 GB/s, 64 cores; CPU Adam: the measured share.
    # Between GPUs: 8 per server over PCIe Gen4 (~25 GB/s per direction); one HDR 200 Gb/s NIC per GPU = 25 GB/s.
    "a100-pcie": HardwareProfile("a100-pcie", 80 * GB, 1.9e12, 312e12, 1000 * GB, 200e9, 64, 25e9, 10e-6,
                                 cpu_adam_bandwidth=cpu_adam_bandwidth(200e9),
                                 source="NVIDIA A100 PCIe datasheet; PCIe Gen4; CPU Adam share measured",
                                 gpus_per_node=8, gpus_per_host=8, intra_node_bandwidth=25e9,
                                 inter_node_bandwidth=25e9),
}

THIS_MACHINE = "this-machine"


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Rate at ``x`` from measured (x, rate) points: log-log linear between the two neighbours, the nearest
    measured rate outside their range."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, r0), (x1, r1) in zip(points, points[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
    return points[-1][1]


def _interpolate_grid(points: dict[tuple, float], x: tuple) -> float:
    """Rate at point ``x`` from rates measured on a grid of shapes: interpolated along the last dimension at
    each measured value of the others, then along those (``_interpolate`` each time)."""
    if len(x) == 1:
        return _interpolate([(shape[0], rate) for shape, rate in points.items()], x[0])
    by_first: dict = {}
    for shape, rate in points.items():
        by_first.setdefault(shape[0], {})[shape[1:]] = rate
    return _interpolate([(first, _interpolate_grid(rest, x[1:])) for first, rest in by_first.items()], x[0])


def profile_cache_path() -> pathlib.Path:
    """Where ``calibrate`` stores this machine's profile (SOCOMPILE_PROFILE_DIR or ~/.cache/socompile)."""
    base = os.environ.get("SOCOMPILE_PROFILE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "socompile")
    return pathlib.Path(base) / f"{THIS_MACHINE}.json"


def profile_from_dict(data: dict, default_name: str = "user") -> HardwareProfile:
    """Build a profile from a mapping with HardwareProfile's field names; errors name the bad key."""
    fields = {f.name: f for f in dataclasses.fields(HardwareProfile)}
    data = dict(data)
    data.setdefault("name", default_name)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        import difflib
        hints = [f"{k!r} (did you mean {difflib.get_close_matches(k, list(fields), n=1)[0]!r}?)"
                 if difflib.get_close_matches(k, list(fields), n=1) else repr(k) for k in unknown]
        raise ValueError(f"hardware profile has unknown key(s) {', '.join(hints)}; known: {', '.join(fields)}")
    required = [f.name for f in fields.values() if f.default is dataclasses.MISSING]
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"hardware profile {data['name']!r} misses {', '.join(missing)}")
    for key in ("device_memory", "host_memory", "host_cores", "device_reserved", "gpus_per_node",
                "gpus_per_host"):
        if key in data:
            data[key] = int(data[key])
    if "device_is_host" in data:
        data["device_is_host"] = bool(data["device_is_host"])
    if "device_kernel_rates" in data:
        data["device_kernel_rates"] = _kernel_rates(data["device_kernel_rates"])
    for key, value in data.items():
        if key not in ("name", "source", "device_kernel_rates") and float(value) < 0:
            raise ValueError(f"hardware profile field {key} must be >= 0, got {value!r}")
    return HardwareProfile(**data)


def _kernel_rates(entries) -> tuple[KernelRate, ...]:
    """``device_kernel_rates`` from a profile file: a list of objects with KernelRate's keys."""
    known = [f.name for f in dataclasses.fields(KernelRate)]
    out = []
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) - set(known) or not {"kernel", "dtype", "rate"} <= set(entry):
            raise ValueError(f"hardware profile device_kernel_rates entry {entry!r} must be an object with keys "
                             f"kernel, dtype, rate (and optionally shape)")
        rate = KernelRate(**entry)
        if float(rate.rate) < 0:
            raise ValueError(f"hardware profile device_kernel_rates rate must be >= 0, got {entry!r}")
        out.append(dataclasses.replace(rate, rate=float(rate.rate), shape=tuple(int(d) for d in rate.shape)))
    return tuple(out)


def load_profile(path: str | os.PathLike) -> HardwareProfile:
    """A user profile from a ``.json`` or ``.toml`` file (same keys as HardwareProfile)."""
    path = pathlib.Path(path)
    if path.suffix == ".toml":
        import tomllib
        data = tomllib.loads(path.read_text())
        data = data.get("profile", data)   # allow a [profile] table or top-level keys
    else:
        data = json.loads(path.read_text())
    return profile_from_dict(data, default_name=path.stem)


def save_profile(profile: HardwareProfile, path: str | os.PathLike) -> pathlib.Path:
    """Write a profile as JSON (sorted keys; ``load_profile`` reads it back)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_dict(), sort_keys=True, indent=1) + "\n")
    return path

