"""The cost model: how long a graph node, a transfer or an optimizer step takes on a hardware profile.

Every formula is written once, over ``int | sympy.Expr`` sizes, so it gives a sympy expression of the symbolic
shapes (batch, sequence) when the IR is symbolic and a number when it is not; ``CostModel.value`` evaluates an
expression at the trace's shapes (or any other shapes) and caches it, so a 20k-node graph with a few hundred
distinct size expressions costs a few hundred sympy evaluations.

    node time       = op latency + max(flops / (peak_flops[dtype] * eff[class]), bytes_moved / (hbm_bw * eff_mem))
                      (op latency: 0 on a GPU, whose launches are queued ahead; a CPU "device" pays its dispatch;
                      a calibrated CPU device: matmul and attention at the FLOP/s measured for their dtype and
                      shape; an elementwise op of a measured family: max(bytes / bw, elements / its measured
                      elements/s); another elementwise op: bytes x the dtype's measured slowdown against fp32)
    view time       = op latency (no data moves, but a CPU "device" dispatches the view; 0 on a GPU)
    transfer time   = latency + bytes / link_bw(direction)
    CPU Adam time   = bucket overhead + numel * bytes_per_param / cpu_adam_bw   (28 B/param fp32, 26 with bf16
                      grads, +2 bf16 copy)
    bucket overhead = per-bucket + tensors * per-gradient-tensor runtime work (Python: receive, bookkeeping,
                      swap, hand-offs), where measured (calibrate on a CPU; 0 in the GPU profiles)
    GPU Adam time   = numel * 30 / (hbm_bw * eff_mem)             (fused AdamW + bf16 weight copy, same streams)
    collective time = steps * latency + bytes sent per rank / (group bandwidth per GPU * NET_EFFICIENCY)
                      (ring reduce-scatter / all-gather: W-1 steps; all-to-all: 1 step, pairwise exchanges)
"""
from __future__ import annotations

import sympy

from ..hardware.cpu_adam import adam_kernel_bytes
from ..hardware.profiles import ADAM_BYTES_BF16_COPY, ADAM_BYTES_FP32_GRAD, HardwareProfile

# Fraction of the datasheet peak that each class of operator reaches. Sources: large bf16 GEMMs on H100 reach
# ~70% of dense peak (NVIDIA's cuBLAS/Transformer Engine benchmarks, ~650-700 of 989 TFLOP/s); FlashAttention-2/3
# forward+backward reaches ~50-60% (FlashAttention-3 paper, H100); elementwise kernels reach ~80% of HBM
# bandwidth (STREAM-like copy kernels on H100).
EFFICIENCY = {"matmul": 0.70, "attention": 0.55, "memory": 0.80, "free": 1.0}
# Fraction of the per-GPU link bandwidth a large NCCL collective reaches (bus bandwidth / line rate). An assumed
# round figure, not measured here: NCCL's own tests report bus bandwidths of roughly 80-90% of the line rate for
# large messages on NVLink and InfiniBand.
NET_EFFICIENCY = 0.80
MATMUL_OPS = ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.convolution", "aten._scaled_mm")
FREE_OPS = ("placeholder", "output", "<built-in function getitem>", "getitem")
# Reshapes that launch no kernel though the IR does not mark them views: AOTAutograd emits
# aten._unsafe_view after a matmul to reshape its fresh output, a view that declares no alias (so it is not
# ``is_view``). Its .out overload writes a copy and is not here.
RESHAPE_OPS = ("aten._unsafe_view.default",)
# Elementwise families whose elements/s calibrate measures on a CPU "device" (KernelRate "elementwise_<family>"):
# a binary op streams its operands; a math op's transcendental work can outlast its bytes; a reduction
# accumulates along rows. Matched on the op's name without overload ("aten.silu_backward.default" ->
# "silu_backward"). Ops of no family are charged their bytes (x the dtype's slowdown).
ELEMENTWISE_FAMILIES = {
    "binary": ("add", "sub", "mul", "div", "where", "neg", "clone", "copy", "_to_copy", "fill", "masked_fill",
               "threshold_backward", "add_", "mul_", "copy_", "rsub", "maximum", "minimum", "clamp"),
    "math": ("silu", "silu_backward", "gelu", "gelu_backward", "exp", "log", "rsqrt", "sqrt", "tanh", "sigmoid",
             "sigmoid_backward", "tanh_backward", "pow", "reciprocal", "erf", "cos", "sin"),
    "reduction": ("sum", "mean", "amax", "amin", "max", "var_mean", "var", "_softmax", "_log_softmax",
                  "_softmax_backward_data", "_log_softmax_backward_data", "native_layer_norm",
                  "native_layer_norm_backward", "logsumexp", "norm", "linalg_vector_norm"),
}
_FAMILY_OF = {name: family for family, names in ELEMENTWISE_FAMILIES.items() for name in names}

Size = "int | sympy.Expr"


def op_class(op: str, is_view: bool = False) -> str:
    """'matmul', 'attention', 'memory' (bandwidth-bound) or 'free' (views, reshapes, placeholders: no kernel)."""
    if is_view or op in FREE_OPS or op in RESHAPE_OPS or op.endswith("getitem"):
        return "free"
    if op.startswith(MATMUL_OPS):
        return "matmul"
    if "attention" in op:
        return "attention"
    return "memory"


def elementwise_family(op: str) -> str | None:
    """The measured family ("binary", "math", "reduction") of an aten op's name ("aten.mul.Tensor"), or None."""
    parts = op.split(".")
    name = parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]
    return _FAMILY_OF.get(name)


def _max(a, b):
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return max(a, b)
    return sympy.Max(a, b)


class CostModel:
    """Formulas of one hardware profile, and their evaluation at given shapes."""

    def __init__(self, hw: HardwareProfile, symbol_values: dict[str, int] | None = None):
        self.hw = hw
        self.symbol_values = dict(symbol_values or {})
        self._subs = {sympy.Symbol(k, integer=True, positive=True): v for k, v in self.symbol_values.items()}
        self._cache: dict = {}

    # ---------------------------------------------------------------- evaluation
    def value(self, expr) -> float:
        """A size or time expression evaluated at this model's shapes."""
        if isinstance(expr, (int, float)):
            return float(expr)
        hit = self._cache.get(expr)
        if hit is None:
            subs = {s: self._value_of(s) for s in expr.free_symbols}
            hit = float(expr.xreplace(subs))
            self._cache[expr] = hit
        return hit

    def _value_of(self, symbol) -> int:
        name = str(symbol)
        if name not in self.symbol_values:
            raise ValueError(f"no value for symbol {name}; give shapes for {sorted(self.symbol_values) or 'it'}")
        return self.symbol_values[name]

    # ---------------------------------------------------------------- formulas
    def node_time(self, op_cls: str, flops, bytes_moved, dtype: str = "", op: str = "", attention_dims=None,
                  elements=0, matmul_dims=None):
        """Seconds of one kernel: compute- or bandwidth-bound, whichever is slower (roofline), at the FLOP rate
        of the dtype it computes in (``str(torch dtype)`` of its output; "" for the bf16 rate). An attention
        kernel (``op`` its name, ``attention_dims`` its query's (tokens, head dim)) and a matmul
        (``matmul_dims``: rows, inner, columns) run at the profile's measured rate for their kind, dtype and
        shape where it has one (flop_rate). An elementwise
        kernel of a family whose elements/s the profile measured in its dtype takes the longer of its bytes'
        time and ``elements`` (its largest operand's) at that rate; another one in a dtype the profile measured
        slower than fp32 takes that much longer than its bytes."""
        if op_cls == "free":
            return 0
        hw = self.hw
        memory = bytes_moved / (hw.device_bandwidth * EFFICIENCY["memory"])
        if op_cls == "memory" or flops == 0:
            family = elementwise_family(op) if op_cls == "memory" and elements else None
            rate = hw.elementwise_rate(family, dtype) if family else None
            if rate:
                return hw.device_op_latency + _max(memory, elements / rate)
            return hw.device_op_latency + memory * hw.elementwise_slowdown(dtype)
        compute = flops / self.flop_rate(op_cls, dtype, op, attention_dims, flops, matmul_dims)
        return hw.device_op_latency + _max(compute, memory)

    def flop_rate(self, op_cls: str, dtype: str = "", op: str = "", attention_dims=None, flops=0,
                  matmul_dims=None) -> float:
        """Achieved FLOP/s of a compute kernel: the profile's rate measured on this kind of kernel at its shape
        where it has one (already achieved: no efficiency factor), else the datasheet rate times the class's
        efficiency. A matmul's shape is its (shortest, longest) dimension (``matmul_dims``; without them, the
        side of the square matmul of its FLOPs); an attention kernel's the (tokens, head dim) of its query."""
        measured = 0.0
        if op_cls == "attention" and attention_dims is not None:
            kernel = "attention_backward" if "backward" in op else "attention"
            measured = self.hw.kernel_flops(kernel, dtype, tuple(self.value(d) for d in attention_dims))
        elif op_cls == "matmul" and isinstance(flops, (int, float)) and flops > 0:
            measured = self.hw.kernel_flops("matmul", dtype, self.matmul_shape(flops, matmul_dims))
        return measured or self.hw.matmul_flops(dtype) * EFFICIENCY[op_cls]

    def matmul_shape(self, flops: float, matmul_dims=None) -> tuple[float, float]:
        """The key a matmul's measured rate is looked up by (KernelRate "matmul"): its shortest and longest
        dimension, or, where its dimensions are not known, those of the square matmul of its FLOPs."""
        if matmul_dims:
            dims = [float(self.value(d)) for d in matmul_dims]
            if min(dims) > 0:
                return min(dims), max(dims)
        side = (flops / 2) ** (1 / 3)
        return side, side

    def view_time(self) -> float:
        """Seconds of a view node: no data moves, but a CPU "device" dispatches it on its cores (0 on a GPU,
        whose profile has no op latency)."""
        return self.hw.device_op_latency

    def transfer_time(self, nbytes, direction: str = "h2d"):
        """Seconds to move ``nbytes`` over the link; direction 'h2d' or 'd2h'."""
        if nbytes == 0:
            return 0
        bw = self.hw.h2d_bandwidth if direction == "h2d" else self.hw.d2h_bandwidth
        return self.hw.link_latency + nbytes / bw

    def ring_time(self, nbytes_sent, group: int, stride: int = 1):
        """Seconds of a ring reduce-scatter or all-gather in which each rank sends ``nbytes_sent``."""
        if group <= 1 or nbytes_sent == 0:
            return 0
        bw = self.hw.group_bandwidth(group, stride) * NET_EFFICIENCY
        return (group - 1) * self.hw.interconnect_latency + nbytes_sent / bw

    def all_to_all_time(self, nbytes_sent, group: int, stride: int = 1):
        """Seconds of an all-to-all in which each rank sends ``nbytes_sent`` (its (P-1)/P share) to its peers."""
        if group <= 1 or nbytes_sent == 0:
            return 0
        bw = self.hw.group_bandwidth(group, stride) * NET_EFFICIENCY
        return self.hw.interconnect_latency + nbytes_sent / bw

    def bucket_overhead(self, tensors: int = 0) -> float:
        """Seconds of the runtime's Python work around one bucket step of ``tensors`` gradient tensors, where
        the profile measured it (0 in the GPU profiles)."""
        return self.hw.cpu_bucket_overhead + tensors * self.hw.cpu_grad_overhead

    def cpu_adam_time(self, numel, grad_dtype_bytes: int = 4, writes_bf16_copy: bool = False,
                      bandwidth_scale: float = 1.0, tensors: int = 0, moment_bytes: float = 4):
        """Seconds of one CPU AdamW step over ``numel`` params of ``tensors`` gradient tensors (memory-bound:
        bytes per param / bandwidth), plus the runtime's work around the bucket's kernel (bucket_overhead)."""
        streamed = sum(adam_kernel_bytes(numel, grad_dtype_bytes, writes_bf16_copy, moment_bytes))   # as booked
        return self.bucket_overhead(tensors) + streamed / (self.hw.adam_bandwidth * bandwidth_scale)

    def cpu_cast_time(self, numel, src_bytes: int = 4, dst_bytes: int = 2):
        """Seconds of a separate cast pass on the CPU (read src, write dst) at the Adam kernel's bandwidth."""
        return numel * (src_bytes + dst_bytes) / self.hw.adam_bandwidth

    def gpu_cast_time(self, numel, src_bytes: int = 4, dst_bytes: int = 2):
        return numel * (src_bytes + dst_bytes) / (self.hw.device_bandwidth * EFFICIENCY["memory"])

    def gpu_adam_time(self, numel):
        return numel * (ADAM_BYTES_FP32_GRAD + ADAM_BYTES_BF16_COPY) / (self.hw.device_bandwidth
                                                                        * EFFICIENCY["memory"])
