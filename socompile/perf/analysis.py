"""Facts about one IR under one cost model that every planner decision reads: per-node times, where each
parameter is used, which layer group it belongs to, and activation memory over the step.

Everything here is computed once per plan in O(nodes + edges); decisions (planner.py) only combine these numbers.

NOTE: activation liveness. A tensor is allocated when its node runs and freed after its last consumer; views
allocate nothing and keep their base alive; a saved forward tensor reaches the backward as a placeholder of the
same name and stays alive until its last backward reader. Parameters (and views of them) are not activations;
gradients of parameters are moved into bucket buffers as they are produced, so they count as freed at once.
A gradient of an optimized parameter (and the tensor it is a view of: a Linear's weight gradient is t(mm(...)))
is not counted at all: until its bucket's step takes it, it is the plan's "gradient staging" (plan/memory.py),
which scales with the bucket, not with the tokens. Nor are the partial gradients of a weight read in two places (a
tied embedding and head, a module called twice): the backward makes one per use and adds them into the gradient,
so they are weight-sized tensors that only feed gradients (``partial_gradients``); the plan walks them with the
gradients (plan/step_timeline.py), live from the node that makes one to its last reader.
"""
from __future__ import annotations

import dataclasses
import re

import sympy
import torch

from ..capture.module_stack import innermost_layer
from ..capture.ir import IR
from .cost import RESHAPE_OPS, CostModel, op_class

_LAYER = re.compile(r"^(.*?\.\d+)\.")


def is_repeated_layer(param: str) -> bool:
    """True for parameters of a repeated block ('layers.3.attn.wq.weight'), False for 'tok_emb.weight'."""
    return _LAYER.match(param) is not None


def layer_group(param: str) -> str:
    """'layers.3.attn.wq.weight' -> 'layers.3'; 'tok_emb.weight' -> 'tok_emb' (the repeated-block prefix)."""
    m = _LAYER.match(param)
    return m.group(1) if m else param.rsplit(".", 1)[0] if "." in param else param


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    """One repeated layer group ('layers.3') as the activation policy sees it (bytes per rank)."""
    name: str
    fw_span: tuple[int, int]     # [first, stop) forward positions of its compute
    bw_span: tuple[int, int]     # [first, stop) backward positions that read its saved tensors
    saved: float                 # bytes of its forward tensors kept for the backward
    saved_expr: object
    boundary: float              # bytes of its input (kept when the layer is recomputed)
    boundary_expr: object
    fw_time: float               # seconds of its forward (the recompute cost)
    bw_time: float               # seconds of the backward nodes in bw_span (hides its offload traffic)
    attention_time: float = 0.0  # seconds of its attention kernels in forward (not re-run by "selective")
    attention_saved: float = 0.0  # bytes of its saved attention outputs (out, logsumexp: kept by "selective")
    attention_saved_expr: object = 0
    # (dtype, bytes) of what crosses the link when the layer offloads: all its saved tensors ("offload"), or
    # its input and attention outputs ("selective_offload"). A bf16 model saves some fp32 tensors (a norm's
    # rsqrt, attention's logsumexp), so one dtype per layer would mislabel them.
    saved_by_dtype: tuple = ()
    selective_by_dtype: tuple = ()
    saved_tensors: int = 0       # how many tensors an offload moves (each one separately: one per saved output)

    @property
    def moved(self) -> float:
        """Bytes an offload of the layer moves each way and holds in host memory: one copy per saved output, as
        the runtime moves them. Two saved views of one tensor (CUDA's attention output, saved as a view and as
        a detach) cross twice, where ``saved``, the device memory they free, counts the tensor once."""
        return float(sum(b for _, b in self.saved_by_dtype)) if self.saved_by_dtype else self.saved


@dataclasses.dataclass
class GraphCosts:
    fw_times: list[float]              # seconds per forward node, in execution order
    bw_times: list[float]
    fw_flops: float
    bw_flops: float
    flops_expr: object                 # fw + bw FLOPs as int or sympy
    fw_uses: dict[str, tuple[int, int]]   # param -> (first, last) forward position that reads it
    bw_uses: dict[str, tuple[int, int]]
    activation_peak: float             # bytes of live activations at the peak (no checkpointing)
    activation_peak_expr: object       # the same as a formula of the symbols
    activation_peak_at: str            # node key where the peak occurs
    saved_bytes: float                 # forward tensors kept for the backward
    saved_expr: object
    checkpoint_bytes: float            # layer-boundary tensors kept under per-layer activation checkpointing
    checkpoint_expr: object
    max_layer_saved: float             # the largest layer's saved tensors (recomputed one layer at a time)
    max_layer_saved_expr: object
    layer_fw_time: float               # forward time of repeated layers (the recompute cost)
    layers: tuple = ()                 # LayerCosts per repeated layer group, in forward order
    fw_attention: tuple = ()           # forward positions of attention kernels (Ulysses all-to-alls around them)
    bw_attention: tuple = ()
    token_shard: int = 1               # sequence-parallel degree the per-rank numbers were divided by
    attention_bytes: tuple = ()        # per forward attention: bytes of q, k, v and its output on one rank
    param_numels: dict = dataclasses.field(default_factory=dict)   # param -> elements (buckets' padded layout)
    # (param whose gradient it feeds, backward position made, last backward position read, bytes) of each
    # partial gradient (a tensor whose values flow only into optimized weights' gradients, not their own storage)
    partial_gradients: tuple = ()

    @property
    def fw_time(self) -> float:
        return sum(self.fw_times)

    @property
    def bw_time(self) -> float:
        return sum(self.bw_times)


def _sum(exprs) -> object:
    ints = 0
    symbolic = []
    for e in exprs:
        if isinstance(e, int):
            ints += e
        else:
            symbolic.append(e)
    return sympy.Add(ints, *symbolic) if symbolic else ints


def _by_dtype(ir: IR, cost: CostModel, keys) -> tuple[tuple[str, float], ...]:
    """(dtype, bytes) of the IR nodes ``keys``, summed per dtype and sorted by name (dtype as the traffic ledger
    names it: "bfloat16", "float32", ...)."""
    out: dict[str, float] = {}
    for key in keys:
        data = ir.graph.nodes[key]
        dtype = str(data.get("dtype", "")).removeprefix("torch.")
        out[dtype] = out.get(dtype, 0.0) + cost.value(data["bytes"])
    return tuple(sorted(out.items()))


def _item_size(data: dict) -> int:
    """Bytes per element of one node's value (4 where it names no dtype)."""
    dtype = getattr(torch, str(data.get("dtype", "")).removeprefix("torch."), None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 4


def _elements(cost: CostModel, data: dict) -> float:
    """Elements of one node's value: its bytes over its dtype's element size (4 where it names none)."""
    return cost.value(data["bytes"]) / _item_size(data)


def _scaled(expr, factor: int):
    """bytes expression / factor (per-rank share of token-proportional bytes)."""
    if factor == 1:
        return expr
    if isinstance(expr, (int, float)):
        return expr / factor
    return expr / factor


def analyze(ir: IR, cost: CostModel, token_shard: int = 1) -> GraphCosts:
    """Per-rank costs. ``token_shard`` (Ulysses sequence parallelism): each rank runs 1/token_shard of every
    token-proportional node (all but the weights: token-wise ops on its seq/sp tokens, attention on all tokens
    for n_heads/sp heads), so node FLOPs, bytes moved and activation bytes are divided by it."""
    g = ir.graph
    shard = max(1, int(token_shard))
    nodes = g.nodes
    param_nodes = _param_aliases(ir)
    fw_times, bw_times = _node_times(ir, cost, ir.fw_order, shard), _node_times(ir, cost, ir.bw_order, shard)
    fw_flops = sum(cost.value(nodes[k]["flops"]) for k in ir.fw_order) / shard
    bw_flops = sum(cost.value(nodes[k]["flops"]) for k in ir.bw_order) / shard
    flops_expr = _scaled(_sum(nodes[k]["flops"] for k in (*ir.fw_order, *ir.bw_order)), shard)

    roots = _view_roots(ir)
    partials = _partial_gradients(ir, roots)
    peak, peak_expr, peak_at, saved_roots, first_bw_use, last_use = _liveness(ir, cost, param_nodes | set(partials),
                                                                              roots)
    base = len(ir.fw_order)
    partial_spans = tuple((param, nodes[key]["order"], last_use[key] - base,
                           int(cost.value(nodes[key]["bytes"]))) for key, param in partials.items())
    saved_expr = _sum(nodes[r]["bytes"] for r in saved_roots)
    ckpt_expr, layer_saved, layer_fw, layers = _checkpoint_estimate(ir, cost, saved_roots, fw_times, param_nodes,
                                                                    first_bw_use, last_use, bw_times,
                                                                    _saved_outputs(ir, param_nodes, roots))
    layer_max_expr = max(layer_saved.values(), key=cost.value, default=0)
    if shard > 1:
        peak, peak_expr = peak / shard, _scaled(peak_expr, shard)
        saved_expr, ckpt_expr, layer_max_expr = (_scaled(e, shard) for e in (saved_expr, ckpt_expr, layer_max_expr))
        layers = [_sharded_layer(lc, shard) for lc in layers]
    attention = {ph: tuple(i for i, k in enumerate(order) if nodes[k]["kind"] == "call_function"
                           and op_class(nodes[k]["op"], nodes[k].get("is_view", False)) == "attention")
                 for ph, order in (("fw", ir.fw_order), ("bw", ir.bw_order))}
    attention_bytes = [_attention_bytes(ir, cost, ir.fw_order[pos], param_nodes) / shard for pos in attention["fw"]]
    return GraphCosts(
        fw_times=fw_times, bw_times=bw_times, fw_flops=fw_flops, bw_flops=bw_flops, flops_expr=flops_expr,
        fw_uses=_uses(ir, ir.fw_readers), bw_uses=_uses(ir, ir.bw_readers), activation_peak=peak,
        activation_peak_expr=peak_expr, activation_peak_at=peak_at, saved_bytes=cost.value(saved_expr),
        saved_expr=saved_expr, checkpoint_bytes=cost.value(ckpt_expr), checkpoint_expr=ckpt_expr,
        max_layer_saved=cost.value(layer_max_expr), max_layer_saved_expr=layer_max_expr, layer_fw_time=layer_fw,
        layers=tuple(layers), fw_attention=attention["fw"], bw_attention=attention["bw"], token_shard=shard,
        attention_bytes=tuple(attention_bytes), param_numels={n: int(p.numel) for n, p in ir.params.items()},
        partial_gradients=partial_spans)


def _node_times(ir: IR, cost: CostModel, order: list[str], shard: int) -> list[float]:
    """Seconds of each node of ``order`` on one rank (1/shard of every token-proportional node)."""
    g, nodes, out = ir.graph, ir.graph.nodes, []
    for key in order:
        data = nodes[key]
        call = data["kind"] == "call_function"
        cls = op_class(data["op"], data.get("is_view", False)) if call else "free"
        if cls == "free":   # a view or reshape still dispatches (on a CPU "device"); placeholders do not
            dispatched = call and (data.get("is_view") or data["op"] in RESHAPE_OPS)
            out.append(float(cost.view_time()) if dispatched else 0.0)
            continue
        moved = cost.value(data["bytes"]) + sum(cost.value(nodes[p]["bytes"]) for p in g.predecessors(key))
        flops = cost.value(data["flops"])
        # an elementwise node's time may be set by its elements (CostModel.node_time): its largest operand's
        elements = max(_elements(cost, nodes[k]) for k in (key, *g.predecessors(key))) if cls == "memory" else 0
        out.append(float(cost.node_time(cls, flops / shard, moved / shard, data.get("dtype", ""), data["op"],
                                        data.get("attention_dims"), elements / shard,
                                        data.get("matmul_dims"))))
    return out


def _uses(ir: IR, readers: dict[str, list[str]]) -> dict[str, tuple[int, int]]:
    """(first, last) order at which each weight is read."""
    nodes, out = ir.graph.nodes, {}
    for p, keys in readers.items():
        # The output node "reads" saved views of weights only to hand them to the backward, where their
        # readers are counted: it is not a use.
        # Views of weights (aten.t saved for the backward) move no data and are re-materialised where used.
        orders = [nodes[k]["order"] for k in keys if nodes[k]["kind"] != "output" and not nodes[k]["is_view"]]
        if orders:
            out[p] = (min(orders), max(orders))
    return out


def _sharded_layer(lc: LayerCosts, shard: int) -> LayerCosts:
    """A layer's activation bytes on one of ``shard`` sequence-parallel ranks."""
    return dataclasses.replace(lc, saved=lc.saved / shard, saved_expr=_scaled(lc.saved_expr, shard),
                               boundary=lc.boundary / shard, boundary_expr=_scaled(lc.boundary_expr, shard),
                               attention_saved=lc.attention_saved / shard,
                               attention_saved_expr=_scaled(lc.attention_saved_expr, shard),
                               saved_by_dtype=tuple((d, b / shard) for d, b in lc.saved_by_dtype),
                               selective_by_dtype=tuple((d, b / shard) for d, b in lc.selective_by_dtype))


def _attention_bytes(ir: IR, cost: CostModel, key: str, param_nodes: set[str]) -> float:
    """Bytes an attention node reads and writes: q, k, v and an output the size of q."""
    nodes = ir.graph.nodes
    inputs = [p for p in ir.graph.predecessors(key) if p not in param_nodes][:3]
    qkv = sum(cost.value(nodes[p]["bytes"]) for p in inputs)
    out = cost.value(nodes[inputs[0]]["bytes"]) if inputs else 0.0
    return qkv + out


def _param_aliases(ir: IR) -> set[str]:
    """Node keys that are parameters or views of parameters (weights, not activations)."""
    return {key for key, data in ir.graph.nodes(data=True) if data.get("alias_of")}


def _view_roots(ir: IR) -> dict[str, str]:
    """Node key -> the node whose storage it is: a view's base (through chains of views), a backward input's
    forward tensor (the saved tensor it is), else itself."""
    g = ir.graph
    forward = set(ir.fw_order)
    root: dict[str, str] = {}
    for key in [*ir.fw_order, *ir.bw_order]:
        data = g.nodes[key]
        preds = [p for p in g.predecessors(key)]
        if key.startswith("bw:") and data["kind"] == "placeholder" and f"fw:{key[3:]}" in forward:
            root[key] = root.get(f"fw:{key[3:]}", f"fw:{key[3:]}")
        elif data.get("is_view") and preds:
            root[key] = root.get(preds[0], preds[0])
        else:
            root[key] = key
    return root


def _partial_gradients(ir: IR, root: dict[str, str]) -> dict[str, str]:
    """Backward tensors (node keys that own their storage) of a weight's size whose values flow only into that
    weight's gradient and are not the gradient's own storage, -> the parameter: the per-use partial gradients of
    a weight read twice (added into its gradient). Token-sized tensors on the way to one gradient (what reaches
    an embedding or a norm's weight) are activations: they scale with the tokens, and checkpointing sees them."""
    g = ir.graph
    grads = {key: n for n, key in ir.grad_node.items() if ir.params[n].optimized}
    staged = {root[key] for key in grads}
    feeds: dict[str, str] = {}     # node -> the parameter whose gradient all its values reach
    for key in reversed(ir.bw_order):
        data = g.nodes[key]
        if data["kind"] != "call_function" or data.get("alias_of"):
            continue
        targets = set()
        for s in g.successors(key):
            if s in grads:
                targets.add(grads[s])
            elif s in feeds:
                targets.add(feeds[s])
            else:
                targets = set()
                break
        if len(targets) == 1:
            feeds[key] = targets.pop()
    def weight_sized(key: str, param: str) -> bool:
        data = g.nodes[key]
        return isinstance(data["bytes"], int) and data["bytes"] == ir.params[param].numel * _item_size(data)

    return {key: p for key, p in feeds.items() if root[key] == key and key not in staged and weight_sized(key, p)}


def _liveness(ir: IR, cost: CostModel, weights: set[str], root: dict[str, str]):
    g = ir.graph
    sequence = [*ir.fw_order, *ir.bw_order]
    position = {k: i for i, k in enumerate(sequence)}
    grads = set(ir.grad_node.values())
    staged = {root[g] for n, g in ir.grad_node.items() if ir.params[n].optimized}   # counted as gradient staging
    weights = weights | staged
    last: dict[str, int] = {}
    for key in sequence:
        r = root[key]
        last[r] = max(last.get(r, position[r]), position[key])
        for s in g.successors(key):
            if g.nodes[s]["kind"] != "output":
                last[r] = max(last[r], position[s])
    frees: dict[int, list[str]] = {}
    for r, end in last.items():
        if r in weights or g.nodes[r]["kind"] == "output":
            continue
        frees.setdefault(position[r] if r in grads else end, []).append(r)
    live = peak = 0.0
    peak_pos = 0
    for i, key in enumerate(sequence):
        if root[key] == key and key not in weights and g.nodes[key]["kind"] != "output":
            live += cost.value(g.nodes[key]["bytes"])
        if live > peak:
            peak, peak_pos = live, i
        for r in frees.get(i, ()):
            live -= cost.value(g.nodes[r]["bytes"])
    at_peak = [r for r, end in last.items() if r not in weights and g.nodes[r]["kind"] != "output"
               and position[r] <= peak_pos and (position[r] if r in grads else end) >= peak_pos]
    expr = _sum(g.nodes[r]["bytes"] for r in sorted(at_peak, key=position.__getitem__))
    boundary = len(ir.fw_order)
    saved = sorted((r for r, end in last.items() if r.startswith("fw:") and end >= boundary and r not in weights
                    and g.nodes[r]["kind"] != "output"), key=position.__getitem__)
    saved_set = set(saved)
    first_bw: dict[str, int] = {}
    for key in ir.bw_order:
        for p in g.predecessors(key):
            r = root.get(p)
            if r in saved_set and g.nodes[key]["kind"] != "output":
                first_bw.setdefault(r, position[key])
    return peak, expr, sequence[peak_pos], saved, first_bw, last


def _saved_outputs(ir: IR, weights: set[str], root: dict[str, str]) -> list[tuple[str, str]]:
    """(saved output, the tensor it is or views) of each forward tensor handed to the backward, in backward
    input order: what the activation offload pass moves, one copy each; views of weights and of graph inputs
    stay where they are. ``root``: _view_roots."""
    g = ir.graph
    saved = [(f"fw:{k[3:]}", root[k]) for k in ir.bw_order if g.nodes[k]["kind"] == "placeholder" and root[k] != k]
    return [(out, r) for out, r in saved if g.nodes[r]["kind"] != "placeholder" and r not in weights]


def _layer_boundaries(ir: IR, fw_times: list[float], weights: set[str]):
    """The repeated layers of the forward (weight groups named ``<...>.<n>``), in forward order: (the layer of
    each forward position, each layer's input bytes expr, the node holding that input, each layer's forward
    seconds)."""
    g = ir.graph
    group_of_pos: list[str | None] = []
    current = None
    boundary: dict[str, object] = {}
    boundary_key: dict[str, str] = {}     # the node whose bytes are the layer's input
    layer_time: dict[str, float] = {}
    for i, key in enumerate(ir.fw_order):
        data = g.nodes[key]
        reads = data["reads_params"] if not data.get("is_view") and data["kind"] != "output" else ()
        if reads:
            group = layer_group(reads[0])
            if group != current and group not in boundary and re.search(r"\.\d+$", group):
                inputs = [p for p in g.predecessors(key) if p not in weights]
                boundary[group] = g.nodes[inputs[0]]["bytes"] if inputs else 0
                if inputs:
                    boundary_key[group] = inputs[0]
            current = group
        group_of_pos.append(current)
        if current is not None and current in boundary:
            layer_time[current] = layer_time.get(current, 0.0) + fw_times[i]
    return group_of_pos, boundary, boundary_key, layer_time


def _checkpoint_estimate(ir: IR, cost: CostModel, saved_roots: list[str], fw_times: list[float],
                         weights: set[str], first_bw_use: dict | None = None, last_use: dict | None = None,
                         bw_times: list[float] | None = None, saved_outputs: list[tuple[str, str]] = ()):
    """Per-layer activation checkpointing, estimated: each repeated layer keeps only its input (the first
    non-weight input of its first weight-reading node); one layer's saved tensors are live while it is
    recomputed. Returns (kept bytes expr, saved bytes expr per layer, forward seconds of repeated layers)."""
    g = ir.graph
    group_of_pos, boundary, boundary_key, layer_time = _layer_boundaries(ir, fw_times, weights)
    per_layer: dict[str, list] = {}
    position = {k: i for i, k in enumerate(ir.fw_order)}
    by_module = any(g.nodes[k].get("modules") for k in ir.fw_order)

    def owner(r: str) -> str | None:
        """The layer a saved tensor belongs to: its module's, as the activation passes read it (a norm's rsqrt
        comes before its weight's first read); in graphs traced without Dynamo (plan reports) the layer of the
        last weight read before it."""
        return innermost_layer(g.nodes[r].get("modules", ()), boundary) if by_module else group_of_pos[position[r]]

    moved: dict[str, list[str]] = {}   # layer -> the saved outputs an offload moves (passes/activation_offload.py)
    for out, r in saved_outputs:
        # the pass reads the saved output's own module first, then its root's
        group = (by_module and owner(out)) or owner(r)
        if group in boundary:
            moved.setdefault(group, []).append(out)
    for r in saved_roots:
        group = owner(r)
        if group in boundary:
            per_layer.setdefault(group, []).append(g.nodes[r]["bytes"])
    saved_per_layer = {k: _sum(v) for k, v in per_layer.items()}
    not_in_layers = _sum(g.nodes[r]["bytes"] for r in saved_roots if owner(r) not in boundary)
    kept = _sum([not_in_layers, *boundary.values()])
    def is_attention(key):
        data = g.nodes[key]
        return data["kind"] == "call_function" and op_class(data["op"], data.get("is_view", False)) == "attention"

    # Saved outputs of attention kernels (out, logsumexp, RNG state: what the attention backward reads besides
    # q, k, v): the tuple's items are getitem nodes of the kernel.
    attention_out = {r for r in saved_roots if any(is_attention(p) for p in g.predecessors(r))}
    layers = []
    n_fw = len(ir.fw_order)
    bw_prefix = [0.0]
    for t in bw_times or ():
        bw_prefix.append(bw_prefix[-1] + t)
    for name in boundary:   # insertion order = forward order
        spots = [i for i, grp in enumerate(group_of_pos) if grp == name]
        roots = [r for r in saved_roots if owner(r) == name]
        firsts = [first_bw_use[r] - n_fw for r in roots if first_bw_use and r in first_bw_use]
        lasts = [last_use[r] - n_fw for r in roots if last_use and r in last_use]
        bw_span = (min(firsts), max(lasts) + 1) if firsts and lasts else (0, 0)
        bw_time = bw_prefix[bw_span[1]] - bw_prefix[bw_span[0]] if bw_times else 0.0
        attention_roots = [r for r in roots if r in attention_out]
        attn_expr = _sum(g.nodes[r]["bytes"] for r in attention_roots)
        checkpoints = [boundary_key[name], *attention_roots] if name in boundary_key else attention_roots
        attn_time = sum(fw_times[i] for i in spots if is_attention(ir.fw_order[i]))
        layers.append(LayerCosts(name=name, fw_span=(min(spots), max(spots) + 1), bw_span=bw_span,
                                 saved=cost.value(saved_per_layer.get(name, 0)),
                                 saved_expr=saved_per_layer.get(name, 0), boundary=cost.value(boundary[name]),
                                 boundary_expr=boundary[name], fw_time=layer_time.get(name, 0.0), bw_time=bw_time,
                                 attention_time=attn_time, attention_saved=cost.value(attn_expr),
                                 attention_saved_expr=attn_expr,
                                 saved_by_dtype=_by_dtype(ir, cost, moved.get(name, ())),
                                 selective_by_dtype=_by_dtype(ir, cost, checkpoints),
                                 saved_tensors=len(moved.get(name, ()))))
    return kept, saved_per_layer, sum(layer_time.values()), layers
