"""The slot (0..3) of each node of a traced graph, read from its tag, and the check that the nodes of slots 1
and 2 repeat one to one, as folding needs."""
from __future__ import annotations

import dataclasses

import torch
from torch import fx

from .blocks import KEPT, TAG, FoldError


def _tag(node: fx.Node) -> int | None:
    custom = node.meta.get("custom")
    return custom.get(TAG) if isinstance(custom, dict) else None


def input_index(node: fx.Node) -> int | None:
    desc = node.meta.get("desc")
    return getattr(desc, "idx", None) if type(desc).__name__ == "PlainAOTInput" else None


def is_size(node: fx.Node) -> bool:
    """A symbolic size (``sym_size``). Copied with its block, but compared and read by value: the first block
    makes some that later blocks share, so sizes are not counted among a block's nodes."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


@dataclasses.dataclass
class Slots:
    """Per node of one graph: its slot (0..3) or None, and its position among its slot's nodes."""
    slot: dict[fx.Node, int]
    members: list[list[fx.Node]]          # per slot, in graph order (state placeholders excluded)
    offset: dict[fx.Node, int]
    state: dict[fx.Node, tuple[int, int]]  # parameter/buffer placeholder -> (slot, position within its slot)

    def slot_of(self, node: fx.Node) -> int | None:
        """The slot of a block node or of a block's parameter input; None outside the blocks."""
        return self.slot[node] if node in self.slot else self.state[node][0] if node in self.state else None


def slots_of(gm: fx.GraphModule, state_slot: dict[int, tuple[int, int]]) -> Slots:
    """The slots of ``gm``'s nodes; ``state_slot``: traced input index -> (slot, position among its state)."""
    slot: dict[fx.Node, int] = {}
    state: dict[fx.Node, tuple[int, int]] = {}
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    for node in nodes:
        idx = input_index(node) if node.op == "placeholder" else None
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
        if node in slot and not is_size(node):
            offset[node] = len(members[slot[node]])
            members[slot[node]].append(node)
    return Slots(slot, members, offset, state)


def role(x: fx.Node, reader_slot: int, s: Slots):
    """How a node of ``reader_slot`` reads ``x``: relative to its own slot, so twins in two slots compare equal."""
    if is_size(x):
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


def check_repeats(gm: fx.GraphModule, s: Slots, phase: str) -> None:
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
                rx, ry = role(x, 1, s), role(y, 2, s)
                if rx != ry or (rx[0] in ("node", "state") and abs(rx[1]) > 1):
                    raise FoldError(f"{phase}: {a.name} reads {x.name} but {b.name} reads {y.name}")
            elif x != y and not (isinstance(x, float) and x != x and y != y):
                raise FoldError(f"{phase}: {a.name} and {b.name} differ in a constant ({x!r} vs {y!r})")
    # Nothing outside the blocks may read the middle slots: the copies would not be read by it.
    middle = set(one) | set(two)
    for node in gm.graph.nodes:
        if node.op != "output" and node not in s.slot and not is_size(node) \
                and any(i in middle for i in node.all_input_nodes):
            raise FoldError(f"{phase}: {node.name}, outside the blocks, reads a middle block")
