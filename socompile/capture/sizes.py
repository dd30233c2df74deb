"""Sizes and FLOPs of FX nodes, as plain ints or as sympy expressions of Dynamo's symbolic shapes.

A node's ``meta["val"]`` is a FakeTensor whose sizes may be SymInts (dynamic batch or sequence); we keep
them symbolic so one plan can be evaluated for many shapes ("peak = 2.1 GB + 0.37 MB * s0").

NOTE: ints where possible. A 7B trace has ~20k nodes; building a sympy Integer product for each static size
cost seconds of planning time and nothing else. Values are plain ``int`` unless a size is symbolic, so
consumers must accept ``int | sympy.Expr`` (``sympy.sympify`` or ``getattr(x, "free_symbols", ())``).
"""
from __future__ import annotations

import sympy
import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry


def to_sympy(value) -> sympy.Expr:
    """A size as a sympy expression (always sympy; see ``to_expr`` for the int-preserving form)."""
    return sympy.sympify(to_expr(value))


def to_expr(value) -> int | sympy.Expr:
    """A size as a plain int when static, a sympy expression when symbolic."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr) if expr.is_Integer else expr
    return int(value)


def tensor_bytes(value) -> int | sympy.Expr:
    """Bytes of every tensor in a node's value (tuples and lists summed); 0 for non-tensors."""
    total: int | sympy.Expr = 0
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            numel: int | sympy.Expr = 1
            for dim in leaf.shape:
                numel = numel * to_expr(dim)
            total = total + numel * leaf.element_size()
    return total


def _cpu_attention_formulas() -> dict:
    """torch's flop registry knows the CUDA SDPA kernels only; planning traces on the CPU, where attention is
    ``_scaled_dot_product_flash_attention_for_cpu`` (and its backward). Without these it counted 0 FLOPs."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
    aten = torch.ops.aten

    def fw(query, key, value, *args, out_val=None, **kwargs):
        return sdpa_flop_count(query.shape, key.shape, value.shape)

    def bw(grad_out, query, key, value, *args, out_val=None, **kwargs):
        return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)

    out = {}
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", fw),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", bw)):
        if hasattr(aten, name):
            out[getattr(aten, name)] = formula
    return out


_EXTRA_FORMULAS = _cpu_attention_formulas()


def causal_fraction(seq: int | sympy.Expr) -> object:
    """Fraction of a square (seq x seq) score matrix causal attention computes: (s+1)/(2s)."""
    if isinstance(seq, int):
        return sympy.Rational(1, 2) + sympy.Rational(1, 2) / seq
    return (seq + 1) / (2 * seq)


def value_dtype(value) -> str:
    """``str(dtype)`` of a node's value: its first tensor's for a tuple (an attention kernel returns its
    output and logsumexp); "" when it holds no tensor."""
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            return str(leaf.dtype)
    return ""


def attention_dims(node) -> tuple | None:
    """(query tokens, head dim) of an attention kernel node, from its first tensor argument (the query, or
    the output gradient of the same shape in backward); None for other nodes. The CPU attention kernels'
    FLOP rate depends on both (KernelRate)."""
    if node.op != "call_function" or "attention" not in str(node.target):
        return None
    first = next((a for a in node.args if hasattr(a, "meta")), None)
    value = first.meta.get("val") if first is not None else None
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    return to_expr(value.shape[-2]), to_expr(value.shape[-1])


# Matmul kernels and the positions of their two matrix operands (the others add a bias or an input).
_MATMUL_OPERANDS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}


def matmul_dims(node) -> tuple | None:
    """(rows, inner, columns) of one matrix product of a matmul node (of each batch entry for ``bmm``), from its
    operands' last two dimensions; None for other nodes or unreadable operands. A CPU's matmul FLOP rate
    depends on the shape, not only on the FLOPs: a bf16 product without bf16 matrix instructions runs ~1.6x
    faster at 1024 x 128 x 128 than at the square of the same FLOPs (KernelRate "matmul")."""
    if node.op != "call_function":
        return None
    packet = getattr(getattr(node, "target", None), "overloadpacket", None)
    positions = _MATMUL_OPERANDS.get(getattr(packet, "__name__", ""))
    if positions is None or len(node.args) <= max(positions):
        return None
    values = [getattr(node.args[i], "meta", {}).get("val") for i in positions]
    if not all(isinstance(v, torch.Tensor) and v.dim() >= 2 for v in values):
        return None
    a, b = values
    return to_expr(a.shape[-2]), to_expr(a.shape[-1]), to_expr(b.shape[-1])


def _causal_fraction(node, args, kwargs) -> object:
    """Fraction of the (s_q x s_k) score matrix a causal attention kernel computes: (s+1)/(2s) for square
    causal attention (FlashAttention skips the blocks above the diagonal), 1 otherwise. torch's formulas
    count the full matrix."""
    schema = getattr(getattr(node, "target", None), "_schema", None)
    if schema is None:
        return 1
    names = [a.name for a in schema.arguments]
    if "is_causal" not in names:
        return 1
    i = names.index("is_causal")
    causal = kwargs.get("is_causal", args[i] if i < len(args) else False)
    if causal is not True:
        return 1
    query = kwargs.get("query", args[names.index("query")] if "query" in names else None)
    if not isinstance(query, torch.Tensor):
        return sympy.Rational(1, 2)
    return causal_fraction(to_expr(query.shape[-2]))


def node_flops(node) -> int | sympy.Expr:
    """FLOPs a kernel executes for matmul/attention/convolution nodes via torch's own flop formulas (causal
    attention: the lower triangle only); 0 for the rest."""
    target = getattr(node, "target", None)
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet) or flop_registry.get(target) or _EXTRA_FORMULAS.get(packet)
    if formula is None:
        return 0

    def value_of(arg):
        return arg.meta.get("val") if hasattr(arg, "meta") else arg

    args = tree_map(value_of, node.args)
    kwargs = tree_map(value_of, node.kwargs)
    try:
        flops = formula(*args, **kwargs, out_val=node.meta.get("val"))
    except Exception:  # a formula that cannot read these args: count nothing rather than fail planning
        return 0
    flops = to_expr(flops)
    if "attention" in str(packet):
        fraction = _causal_fraction(node, args, kwargs)
        if fraction != 1:
            flops = flops * fraction
            if isinstance(flops, sympy.Expr) and flops.is_Number:
                flops = int(flops)
    return flops


def free_symbols(value) -> set:
    """Free sympy symbols of an int-or-expression size."""
    return set(getattr(value, "free_symbols", ()))


def shape_env_values(value) -> dict[str, int]:
    """Concrete hint of every backed symbol known to the ShapeEnv of a FakeTensor value ({} when static)."""
    for leaf in tree_flatten(value)[0]:
        mode = getattr(leaf, "fake_mode", None)
        env = getattr(mode, "shape_env", None)
        if env is None:
            continue
        table = getattr(env, "backed_var_to_val", None)
        if table is None:
            table = env.var_to_val
        return {str(k): int(v) for k, v in table.items()}
    return {}
