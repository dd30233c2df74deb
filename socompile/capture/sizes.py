"""Sizes and FLOPs of FX nodes as sympy expressions of Dynamo's symbolic shapes.

A node's ``meta["val"]`` is a FakeTensor whose sizes may be SymInts (dynamic batch or sequence); we keep
them symbolic so one plan can be evaluated for many shapes ("peak = 2.1 GB + 0.37 MB * s0").
"""
from __future__ import annotations

import sympy
import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry


def to_sympy(value) -> sympy.Expr:
    if isinstance(value, torch.SymInt):
        return sympy.sympify(value.node.expr)
    return sympy.Integer(int(value))


def tensor_bytes(value) -> sympy.Expr:
    """Bytes of every tensor in a node's value (tuples and lists summed); 0 for non-tensors."""
    total = sympy.Integer(0)
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            numel = sympy.Integer(1)
            for dim in leaf.shape:
                numel *= to_sympy(dim)
            total += numel * leaf.element_size()
    return total


def node_flops(node) -> sympy.Expr:
    """FLOPs of matmul/attention/convolution nodes via torch's own flop formulas; 0 for the rest."""
    target = getattr(node, "target", None)
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet) or flop_registry.get(target)
    if formula is None:
        return sympy.Integer(0)

    def value_of(arg):
        return arg.meta.get("val") if hasattr(arg, "meta") else arg

    args = tree_map(value_of, node.args)
    kwargs = tree_map(value_of, node.kwargs)
    try:
        flops = formula(*args, **kwargs, out_val=node.meta.get("val"))
    except Exception:  # a formula that cannot read these args: count nothing rather than fail planning
        return sympy.Integer(0)
    return to_sympy(flops)
