"""Trace four blocks of a deep model, not all of them: the training graphs of an n-block model are rebuilt from
the traced graphs of blocks 0, 1, 2 and n-1 by repeating block 2.

Why: tracing is most of the cost of a plan (AOTAutograd's joint trace and min-cut partition grow with every
block: about 18 s of a 7B plan). Transformer blocks are identical, so their forward and backward nodes
repeat with a fixed period; copying a traced block is exact and takes a fraction of a second.

How the blocks of each node are known: while tracing, a forward hook on each kept block puts the block's slot
into ``node.meta["custom"]`` (``torch.fx.traceback.annotate``); AOTAutograd carries it to the backward nodes
derived from that block. The few backward nodes autograd makes outside any block (gradient sums between two
blocks) take the slot of the node before them.

Folding is refused (and the caller traces the whole model) unless:
  * the blocks are one ``nn.ModuleList`` of at least ``MIN_BLOCKS`` modules of the same structure (types,
    parameter and buffer shapes, plain attributes such as ``eps``), so a behaviour keyed on a block index
    (``self.layer_idx``) is never folded;
  * in both graphs, the nodes of slots 1 and 2 correspond one to one (same op, same constants) and read their
    neighbours the same way: a node of slot 2 reads slot 1 (or 3) where its twin in slot 1 reads slot 0 (or 2),
    at the same position, and both read the same nodes outside the blocks;
  * the slots' nodes form runs that repeat, so each copy has one place in the execution order.
The result is checked against a full trace in tests/test_fold.py: identical IR sizes and an identical plan.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterator

import torch
from torch import fx, nn

log = logging.getLogger(__name__)

MIN_BLOCKS = 6        # folding 5 or fewer blocks saves too little to be worth a second code path
KEPT = 4              # slots traced: blocks 0, 1, 2 and n-1; slot 2 is the template of the copies
_TAG = "socompile_fold_slot"


class FoldError(RuntimeError):
    """The traced graphs do not repeat as folding needs; the caller traces every block instead."""


@dataclasses.dataclass(frozen=True)
class Blocks:
    path: str             # module path of the ModuleList, e.g. "layers"
    count: int


# ---- finding the repeated blocks --------------------------------------------------------------------------

def _plain_attributes(module: nn.Module) -> dict:
    skip = {"training"}
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and k not in skip and isinstance(v, (int, float, str, bool, type(None), tuple))}


def _signature(block: nn.Module) -> tuple:
    mods = tuple((name, type(m).__qualname__, tuple(sorted(_plain_attributes(m).items())))
                 for name, m in block.named_modules())
    tensors = tuple((name, tuple(t.shape), t.dtype, getattr(t, "requires_grad", False))
                    for name, t in [*block.named_parameters(), *block.named_buffers()])
    return mods, tensors


def find_blocks(model: nn.Module) -> Blocks | None:
    """The longest ``nn.ModuleList`` of structurally identical blocks, if it has at least ``MIN_BLOCKS``."""
    best: Blocks | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < MIN_BLOCKS:
            continue
        first = _signature(module[0])
        if any(_signature(b) != first for b in module[1:]):
            log.debug("not folding %s: its blocks differ in structure", path)
            continue
        if best is None or len(module) > best.count:
            best = Blocks(path, len(module))
    return best


def kept_indices(count: int) -> list[int]:
    return [0, 1, 2, count - 1]


@contextlib.contextmanager
def traced_subset(model: nn.Module, blocks: Blocks) -> Iterator[None]:
    """Swap the block list for blocks 0, 1, 2, n-1 and tag every node each one traces with its slot."""
    from torch.fx import traceback as fx_traceback
    if not hasattr(fx_traceback, "annotate"):
        raise FoldError("this torch has no torch.fx.traceback.annotate to tag the blocks' nodes")
    parent_path, _, attr = blocks.path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    full = getattr(parent, attr)
    kept = nn.ModuleList([full[i] for i in kept_indices(len(full))])
    handles, open_tags = [], {}
    for slot, block in enumerate(kept):
        def enter(_module, _args, slot=slot):
            stack = contextlib.ExitStack()
            stack.enter_context(fx_traceback.annotate({_TAG: slot}))
            open_tags[slot] = stack

        def leave(_module, _args, _out, slot=slot):
            open_tags.pop(slot).close()
        handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    setattr(parent, attr, kept)
    try:
        with fx_traceback.preserve_node_meta():
            try:
                yield
            finally:
                # A block that raised never ran its forward hook: unwind its tag here, innermost first and inside
                # preserve_node_meta (which resets the node meta on exit; an annotate() closed after that fails
                # with KeyError 'custom' and hides the block's own error).
                for slot in sorted(open_tags, reverse=True):
                    open_tags.pop(slot).close()
    finally:
        setattr(parent, attr, full)
        for h in handles:
            h.remove()


# ---- slots of the traced nodes ------------------------------------------------------------------------------

def _tag(node: fx.Node) -> int | None:
    custom = node.meta.get("custom")
    return custom.get(_TAG) if isinstance(custom, dict) else None


def _input_index(node: fx.Node) -> int | None:
    desc = node.meta.get("desc")
    return getattr(desc, "idx", None) if type(desc).__name__ == "PlainAOTInput" else None


def _is_size(node: fx.Node) -> bool:
    """A symbolic size (``sym_size``). Copied with its block, but compared and read by value: the first block
    makes some that later blocks share, so sizes are not counted among a block's nodes."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


@dataclasses.dataclass
class _Slots:
    """Per node of one graph: its slot (0..3) or None, and its position among its slot's nodes."""
    slot: dict[fx.Node, int]
    members: list[list[fx.Node]]          # per slot, in graph order (state placeholders excluded)
    offset: dict[fx.Node, int]
    state: dict[fx.Node, tuple[int, int]]  # parameter/buffer placeholder -> (slot, position within its slot)

    def slot_of(self, node: fx.Node) -> int | None:
        """The slot of a block node or of a block's parameter input; None outside the blocks."""
        return self.slot[node] if node in self.slot else self.state[node][0] if node in self.state else None


def _slots(gm: fx.GraphModule, state_slot: dict[int, tuple[int, int]]) -> _Slots:
    slot: dict[fx.Node, int] = {}
    state: dict[fx.Node, tuple[int, int]] = {}
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    for node in nodes:
        idx = _input_index(node) if node.op == "placeholder" else None
        if idx is not None:
            if idx in state_slot:
                state[node] = state_slot[idx]
            continue
        tag = _tag(node)
        if tag is not None:
            slot[node] = tag
    # Nodes autograd makes between two blocks' backward (sums of gradients) carry no tag: give them the slot of
    # the node before them, if they read a block's node (a recomputed slice of a rotary table read only by
    # blocks stays outside them). After the last block this gathers what follows into slot 0 or 3, which are
    # never copied.
    tagged = [i for i, n in enumerate(nodes) if n in slot and n.op == "call_function"]
    if tagged:
        current = None
        for node in nodes[tagged[0]:]:
            if node.op != "call_function":
                continue
            if node in slot:
                current = slot[node]
            elif any(i in slot for i in node.all_input_nodes):
                slot[node] = current
    members: list[list[fx.Node]] = [[] for _ in range(KEPT)]
    offset: dict[fx.Node, int] = {}
    for node in nodes:
        if node in slot and not _is_size(node):
            offset[node] = len(members[slot[node]])
            members[slot[node]].append(node)
    return _Slots(slot, members, offset, state)


def _role(x: fx.Node, reader_slot: int, s: _Slots):
    """How a node of ``reader_slot`` reads ``x``: relative to its own slot, so twins in two slots compare equal."""
    if _is_size(x):
        return ("size", str(x.meta["val"]))
    if x in s.slot:
        return ("node", s.slot[x] - reader_slot, s.offset[x])
    if x in s.state:
        slot, pos = s.state[x]
        return ("state", slot - reader_slot, pos)
    return ("outside", x)


def _shape(node: fx.Node):
    val = node.meta.get("val")
    return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else type(val).__name__


def _leaves(node: fx.Node) -> list:
    flat: list = []
    fx.node.map_aggregate((node.args, node.kwargs), flat.append)
    return flat


def _check_repeats(gm: fx.GraphModule, s: _Slots, phase: str) -> None:
    one, two = s.members[1], s.members[2]
    if not one or not two:   # this torch does not carry the block tags to these nodes
        raise FoldError(f"{phase}: the graph's nodes carry no block tags")
    if len(one) != len(two):
        raise FoldError(f"{phase}: block slots 1 and 2 have {len(one)} and {len(two)} nodes")
    for a, b in zip(one, two):
        same_kind = a.op == b.op and (a.op == "placeholder" or a.target == b.target)   # a placeholder's target is its name
        if not same_kind or _shape(a) != _shape(b):
            raise FoldError(f"{phase}: {a.name} ({a.target}) and {b.name} ({b.target}) differ")
        la, lb = _leaves(a), _leaves(b)
        if len(la) != len(lb):
            raise FoldError(f"{phase}: {a.name} and {b.name} take different arguments")
        for x, y in zip(la, lb):
            if isinstance(x, fx.Node) != isinstance(y, fx.Node):
                raise FoldError(f"{phase}: {a.name} and {b.name} take different arguments")
            if isinstance(x, fx.Node):
                rx, ry = _role(x, 1, s), _role(y, 2, s)
                if rx != ry or (rx[0] in ("node", "state") and abs(rx[1]) > 1):
                    raise FoldError(f"{phase}: {a.name} reads {x.name} but {b.name} reads {y.name}")
            elif x != y and not (isinstance(x, float) and x != x and y != y):
                raise FoldError(f"{phase}: {a.name} and {b.name} differ in a constant ({x!r} vs {y!r})")
    # Nothing outside the blocks may read the middle slots: the copies would not be read by it.
    middle = set(one) | set(two)
    for node in gm.graph.nodes:
        if node.op != "output" and node not in s.slot and not _is_size(node) \
                and any(i in middle for i in node.all_input_nodes):
            raise FoldError(f"{phase}: {node.name}, outside the blocks, reads a middle block")


# ---- repeating slot 2 in an ordered sequence ------------------------------------------------------------------

def _runs(labels: list[int | None]) -> list[tuple[int | None, int, int]]:
    """(label, start, end) of maximal runs of equal labels."""
    runs, start = [], 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            runs.append((labels[start], start, i))
            start = i
    return runs


def _expand_order(labels: list[int | None], copies: list[int], what: str) -> list[tuple[int, int | None]]:
    """The order of a sequence once slot 2's items are repeated for ``copies`` (the new blocks' indices):
    (position in the traced sequence, copy or None for the traced item itself). Where slot 2's run is followed
    by slot 3 (or follows slot 1) the copies come after it in increasing order; where the runs go down (the
    backward, and the saved weights at the forward's end) they come before it, the highest first."""
    runs = _runs(labels)
    shape = [(lab, end - start) for lab, start, end in runs if lab in (1, 2)]
    ones = [n for lab, n in shape if lab == 1]
    twos = [n for lab, n in shape if lab == 2]
    if ones != twos:
        raise FoldError(f"{what}: block slots 1 and 2 do not form matching runs ({ones} vs {twos})")
    out: list[tuple[int, int | None]] = []
    for i, (lab, start, end) in enumerate(runs):
        items = range(start, end)
        if lab != 2:
            out += [(j, None) for j in items]
            continue
        before = runs[i - 1][0] if i > 0 else None
        after = runs[i + 1][0] if i + 1 < len(runs) else None
        if before == 1 or after == 3:
            out += [(j, None) for j in items]
            out += [(j, c) for c in copies for j in items]
        elif before == 3 or after == 1:
            out += [(j, c) for c in reversed(copies) for j in items]
            out += [(j, None) for j in items]
        else:
            raise FoldError(f"{what}: cannot place the copies of block slot 2 (neighbours {before}, {after})")
    return out


# ---- rebuilding the graphs ------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Layout:
    """How traced inputs map to the full model's inputs."""
    count: int                              # blocks in the full model
    state_slot: dict[int, tuple[int, int]]  # traced input index -> (slot, position among the slot's state)
    new_index: dict[int, int]               # traced input index of a traced (not copied) input -> full index
    copy_index: dict[tuple[int, int], int]  # (copy block, position among slot 2's state) -> full input index

    def full_block(self, slot: int) -> int:
        return kept_indices(self.count)[slot]

    @property
    def copies(self) -> list[int]:
        return list(range(3, self.count - 1))

    def block_of(self, slot: int | None, copy: int | None) -> int | None:
        return copy if copy is not None else (None if slot is None else self.full_block(slot))


class _Builder:
    """Writes the expanded graph of one phase."""

    def __init__(self, s: _Slots, layout: _Layout, phase: str):
        self.s, self.layout, self.phase = s, layout, phase
        self.graph = fx.Graph()
        self.env: dict[tuple[fx.Node, int | None], fx.Node] = {}   # (traced node, copy) -> new node
        self.state_at = {where: node for node, where in s.state.items()}   # (slot, position) -> placeholder

    # The block (full index) a traced node or its copy stands for.
    def _block(self, node: fx.Node, copy: int | None) -> int | None:
        return self.layout.block_of(self.s.slot_of(node), copy)

    def _slot_of_block(self, block: int) -> tuple[int, int | None]:
        """(traced slot whose nodes stand for ``block``, copy or None)."""
        kept = kept_indices(self.layout.count)
        if block in kept:
            return kept.index(block), None
        return 2, block

    def _lookup(self, x: fx.Node, reader: fx.Node, copy: int | None) -> fx.Node:
        s = self.s
        reader_block = self._block(reader, copy)
        if reader_block is None or (x not in s.slot and x not in s.state):
            return self.env[(x, None)]
        reader_slot = s.slot_of(reader)
        if _is_size(x):   # equal in every block: a copy reads its own where its template does, else the same one
            return self.env[(x, copy if copy is not None and s.slot.get(x) == 2 else None)]
        kind, delta, pos = _role(x, reader_slot, s)
        slot, which = self._slot_of_block(reader_block + delta)
        if kind == "node":
            return self.env[(s.members[slot][pos], which)]
        return self.env[(self.state_at[(slot, pos)], which)]

    def _full_index(self, node: fx.Node, copy: int | None) -> int | None:
        """The full model's input index of an input placeholder (or of its copy); None for other nodes."""
        idx = _input_index(node) if node.op == "placeholder" else None
        if idx is None:
            return None
        return self.layout.new_index[idx] if copy is None else self.layout.copy_index[(copy, self.s.state[node][1])]

    def _name(self, node: fx.Node, copy: int | None) -> str:
        full = self._full_index(node, copy)
        if full is not None:
            return f"primals_{full + 1}"      # as a trace of the full model names its inputs
        if copy is None:
            return node.name
        return f"{node.name}_b{copy}"

    def emit(self, node: fx.Node, copy: int | None) -> None:
        if node.op == "output":
            raise AssertionError("outputs are written by write_output")

        def arg(x: fx.Node) -> fx.Node:
            return self._lookup(x, node, copy)
        args = fx.node.map_arg(node.args, arg)
        kwargs = fx.node.map_arg(node.kwargs, arg)
        name = self._name(node, copy)
        target = name if node.op == "placeholder" else node.target   # a placeholder's target is its argument name
        new = self.graph.create_node(node.op, target, args, kwargs, name=name, type_expr=node.type)
        if new.name != name:
            raise FoldError(f"{self.phase}: node name {name} is taken")
        new.meta = _meta_without_tag(node.meta)
        full = self._full_index(node, copy)
        if full is not None:
            new.meta["desc"] = dataclasses.replace(node.meta["desc"], idx=full)
        self.env[(node, copy)] = new

    def write_output(self, output: fx.Node, labels: list[int | None], rewrite_desc) -> None:
        values, descs = list(output.args[0]), list(output.meta.get("desc") or [None] * len(output.args[0]))
        new_values, new_descs = [], []
        for position, copy in _expand_order(labels, self.layout.copies, f"{self.phase} outputs"):
            value = values[position]
            if isinstance(value, fx.Node):
                # An output stands for the block of its label: look it up as that block's node would.
                value = self._output_value(value, labels[position], copy)
            new_values.append(value)
            new_descs.append(rewrite_desc(descs[position], copy, len(new_descs)))
        new = self.graph.output(tuple(new_values))
        new.meta = _meta_without_tag(output.meta)
        new.meta["desc"] = new_descs

    def _output_value(self, value: fx.Node, label: int | None, copy: int | None) -> fx.Node:
        if copy is None:
            return self.env[(value, None)]
        s = self.s
        if _is_size(value):
            return self.env[(value, copy if s.slot.get(value) == 2 else None)]
        if value in s.slot:
            return self.env[(s.members[2][s.offset[value]], copy)]
        if value in s.state:
            return self.env[(value, copy)]
        raise FoldError(f"{self.phase}: output {value.name} of block slot {label} is not a block node")


def _meta_without_tag(meta: dict) -> dict:
    out = dict(meta)
    custom = out.get("custom")
    if isinstance(custom, dict) and _TAG in custom:
        rest = {k: v for k, v in custom.items() if k != _TAG}
        if rest:
            out["custom"] = rest
        else:
            del out["custom"]
    return out


def _build(gm: fx.GraphModule, s: _Slots, layout: _Layout, phase: str, output_labels, rewrite_desc
           ) -> fx.GraphModule:
    builder = _Builder(s, layout, phase)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    labels = [s.slot_of(n) for n in nodes]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    try:
        for position, copy in _expand_order(labels, layout.copies, f"{phase} graph"):
            builder.emit(nodes[position], copy)
        builder.write_output(output, output_labels(output, s), rewrite_desc)
    except KeyError as exc:   # the expanded order would read a node before making it
        raise FoldError(f"{phase}: a copied node reads {exc} before it is made") from None
    builder.graph.lint()
    return fx.GraphModule(gm, builder.graph)


def expand(fw: fx.GraphModule, bw: fx.GraphModule, layout: _Layout) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward graphs of the full model from those of the four traced blocks."""
    sf = _slots(fw, layout.state_slot)
    sb = _slots(bw, layout.state_slot)
    _check_repeats(fw, sf, "forward")
    _check_repeats(bw, sb, "backward")

    def fw_labels(output: fx.Node, s: _Slots) -> list[int | None]:
        return [s.slot_of(v) if isinstance(v, fx.Node) else None for v in output.args[0]]

    saved_count = [0]

    def fw_desc(desc, copy, position):
        if type(desc).__name__.startswith("SavedForBackwards"):   # numbered in order among the saved outputs
            saved_count[0] += 1
            return dataclasses.replace(desc, idx=saved_count[0] - 1)
        return desc

    def bw_labels(output: fx.Node, s: _Slots) -> list[int | None]:
        descs = output.meta.get("desc") or []
        return [layout.state_slot.get(getattr(getattr(d, "grad_of", None), "idx", None), (None,))[0] for d in descs]

    state_pos = {idx: pos for idx, (_, pos) in layout.state_slot.items()}

    def bw_desc(desc, copy, position):
        grad_of = getattr(desc, "grad_of", None)
        idx = getattr(grad_of, "idx", None)
        if idx is None:
            return desc
        full = layout.new_index[idx] if copy is None else layout.copy_index[(copy, state_pos[idx])]
        return dataclasses.replace(desc, grad_of=dataclasses.replace(grad_of, idx=full))

    new_fw = _build(fw, sf, layout, "forward", fw_labels, fw_desc)
    new_bw = _build(bw, sb, layout, "backward", bw_labels, bw_desc)
    return new_fw, new_bw


def layout_for(traced_names: list[str], full_names: list[str], blocks: Blocks, n_other_inputs: int) -> _Layout:
    """Map the traced model's inputs (parameters and buffers of blocks 0, 1, 2, n-1, then the rest) to the
    full model's, and give every copied block's parameters their full input index."""
    kept = kept_indices(blocks.count)
    full_index = {name: i for i, name in enumerate(full_names)}
    head = blocks.path + "."

    def split(name: str) -> tuple[int, str] | None:
        if not name.startswith(head):
            return None
        number, _, rest = name[len(head):].partition(".")
        return (int(number), rest) if number.isdigit() else None

    state_slot: dict[int, tuple[int, int]] = {}
    new_index: dict[int, int] = {}
    per_slot: list[list[str]] = [[] for _ in range(KEPT)]
    for idx, name in enumerate(traced_names):
        where = split(name)
        full_name = name if where is None else f"{head}{kept[where[0]]}.{where[1]}"
        if full_name not in full_index:
            raise FoldError(f"traced input {name} has no counterpart {full_name} in the full model")
        new_index[idx] = full_index[full_name]
        if where is not None:
            state_slot[idx] = (where[0], len(per_slot[where[0]]))
            per_slot[where[0]].append(where[1])
    for extra in range(n_other_inputs):
        new_index[len(traced_names) + extra] = len(full_names) + extra
    copy_index = {}
    for copy in range(3, blocks.count - 1):
        for pos, rest in enumerate(per_slot[2]):
            name = f"{head}{copy}.{rest}"
            if name not in full_index:
                raise FoldError(f"block {copy} has no {name}")
            copy_index[(copy, pos)] = full_index[name]
    covered = set(new_index.values()) | set(copy_index.values())
    if covered != set(range(len(full_names) + n_other_inputs)):
        raise FoldError("the kept and copied blocks do not account for every parameter of the model")
    return _Layout(count=blocks.count, state_slot=state_slot, new_index=new_index, copy_index=copy_index)
