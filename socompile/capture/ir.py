"""The IR the planner reads: forward and backward FX graphs as one networkx DiGraph, with sizes,
parameter identities, aliases of parameters, and where each gradient is produced.

Nodes are keyed ``"fw:<name>"`` / ``"bw:<name>"`` and carry:
``phase``, ``order`` (execution index within its phase), ``op`` (target as text), ``bytes`` and ``flops``
(plain ``int`` when static, sympy when symbolic; see capture/sizes.py), ``is_view``, ``alias_of`` (the
parameter this node is, or is a view of, else None),
``reads_params`` (names of parameters the node reads, directly or through a view), ``modules`` (the module
paths of its ``nn_module_stack``, outermost first; () when traced without Dynamo) and ``stack_trace``. Edges are data dependencies.

NOTE: saved views of parameters. The partitioners save ``aten.t(primals_k)``-style views of weights for the
backward. Such a view keeps the weight alive and reads its storage, so we treat it as an alias of the
parameter: a node that reads the view reads the parameter.
"""
from __future__ import annotations

import dataclasses

import networkx as nx
import sympy
import torch
from torch import fx

from .module_stack import module_paths
from .params import ParamInfo
from .sizes import (attention_dims, free_symbols, matmul_dims, node_flops, shape_env_values, tensor_bytes,
                    value_dtype)


@dataclasses.dataclass
class IR:
    graph: nx.DiGraph
    params: dict[str, ParamInfo]              # by name, in graph-input order
    fw_order: list[str]                       # forward node keys in execution order
    bw_order: list[str]                       # backward node keys in execution order
    grad_node: dict[str, str]                 # param name -> bw node key that produces its gradient
    grad_output_index: dict[str, int]         # param name -> position in the backward graph's outputs
    bw_readers: dict[str, list[str]]          # param name -> bw node keys that read it (or an alias)
    fw_readers: dict[str, list[str]]
    symbol_values: dict[str, int] = dataclasses.field(default_factory=dict)  # hint of each symbol (trace shape)
    symbol_names: dict[str, str] = dataclasses.field(default_factory=dict)   # e.g. {"s31": "batch"} for reports

    @property
    def symbols(self) -> list[sympy.Symbol]:
        free: set[sympy.Symbol] = set()
        for _, data in self.graph.nodes(data=True):
            free |= free_symbols(data["bytes"]) | free_symbols(data["flops"])
        return sorted(free, key=str)

    def grad_order(self) -> list[str]:
        """Parameters with a gradient, in the order backward produces them (ties by name)."""
        position = {key: i for i, key in enumerate(self.bw_order)}
        named = [n for n in self.grad_node if self.params[n].requires_grad]
        return sorted(named, key=lambda n: (position[self.grad_node[n]], n))


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _aot_input_index(node: fx.Node) -> int | None:
    desc = node.meta.get("desc")
    idx = getattr(desc, "idx", None)
    return idx if type(desc).__name__ == "PlainAOTInput" else None


def _add_phase(g: nx.DiGraph, gm: fx.GraphModule, phase: str, alias: dict[str, str],
               param_by_input: dict[int, str]) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
    """Add one phase's nodes; return (order, readers per param, alias map of this phase's nodes)."""
    order: list[str] = []
    readers: dict[str, list[str]] = {}
    local_alias: dict[str, str] = {}
    for i, node in enumerate(gm.graph.nodes):
        key = f"{phase}:{node.name}"
        order.append(key)
        reads = set()
        if node.op == "placeholder":
            idx = _aot_input_index(node)
            if idx is not None and idx in param_by_input:
                local_alias[node.name] = param_by_input[idx]
            elif node.name in alias:  # a saved forward tensor that is a view of a parameter
                local_alias[node.name] = alias[node.name]
        else:
            for inp in node.all_input_nodes:
                if inp.name in local_alias:
                    reads.add(local_alias[inp.name])
            if _is_view(node) and node.args and isinstance(node.args[0], fx.Node) \
                    and node.args[0].name in local_alias:
                local_alias[node.name] = local_alias[node.args[0].name]
        for p in sorted(reads):
            readers.setdefault(p, []).append(key)
        g.add_node(key, phase=phase, order=i, op=str(node.target) if node.op != "placeholder" else "placeholder",
                   kind=node.op, is_view=_is_view(node), alias_of=local_alias.get(node.name),
                   bytes=tensor_bytes(node.meta.get("val")), flops=node_flops(node),
                   dtype=value_dtype(node.meta.get("val")), attention_dims=attention_dims(node),
                   matmul_dims=matmul_dims(node),
                   reads_params=tuple(sorted(reads)), modules=module_paths(node),
                   stack_trace=node.meta.get("stack_trace"))
        for inp in node.all_input_nodes:
            g.add_edge(f"{phase}:{inp.name}", key)
    return order, readers, local_alias


def build_ir(fw: fx.GraphModule, bw: fx.GraphModule, params: list[ParamInfo]) -> IR:
    """Build the IR from the partitioned forward and backward graphs of one AOTAutograd compile."""
    g = nx.DiGraph()
    param_by_input = {p.input_index: p.name for p in params}
    fw_order, fw_readers, fw_alias = _add_phase(g, fw, "fw", {}, param_by_input)
    # Saved tensors reach the backward as placeholders with the forward node's name.
    bw_order, bw_readers, _ = _add_phase(g, bw, "bw", fw_alias, param_by_input)
    for name in fw_alias:
        if f"bw:{name}" in g:
            g.add_edge(f"fw:{name}", f"bw:{name}", saved=True)

    output = next(n for n in bw.graph.nodes if n.op == "output")
    descs = output.meta.get("desc") or [None] * len(output.args[0])
    grad_node, grad_index = {}, {}
    for position, (value, desc) in enumerate(zip(output.args[0], descs)):
        grad_of = getattr(desc, "grad_of", None)
        idx = getattr(grad_of, "idx", position)  # without descriptors, outputs follow forward-input order
        if isinstance(value, fx.Node) and idx in param_by_input:
            grad_node[param_by_input[idx]] = f"bw:{value.name}"
            grad_index[param_by_input[idx]] = position
    hints: dict[str, int] = {}
    for node in fw.graph.nodes:
        if node.op == "placeholder":
            hints = shape_env_values(node.meta.get("val"))
            if hints:
                break
    return IR(graph=g, params={p.name: p for p in params}, fw_order=fw_order, bw_order=bw_order,
              grad_node=grad_node, grad_output_index=grad_index, bw_readers=bw_readers, fw_readers=fw_readers,
              symbol_values=hints)
