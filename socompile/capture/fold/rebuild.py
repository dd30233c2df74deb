"""Writing the full model's forward and backward graphs from those of the four traced blocks: every node of
slot 2 emitted again for each block that was not traced, reading its own block's nodes and parameters."""
from __future__ import annotations

import dataclasses

from torch import fx

from .blocks import TAG, FoldError, kept_indices
from .layout import Layout
from .order import expand_order
from .slots import Slots, check_repeats, input_index, is_size, role, slots_of


class _Builder:
    """Writes the expanded graph of one phase."""

    def __init__(self, s: Slots, layout: Layout, phase: str):
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
        if is_size(x):   # equal in every block: a copy reads its own where its template does, else the same one
            return self.env[(x, copy if copy is not None and s.slot.get(x) == 2 else None)]
        kind, delta, pos = role(x, reader_slot, s)
        slot, which = self._slot_of_block(reader_block + delta)
        if kind == "node":
            return self.env[(s.members[slot][pos], which)]
        return self.env[(self.state_at[(slot, pos)], which)]

    def _full_index(self, node: fx.Node, copy: int | None) -> int | None:
        """The full model's input index of an input placeholder (or of its copy); None for other nodes."""
        idx = input_index(node) if node.op == "placeholder" else None
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
        for position, copy in expand_order(labels, self.layout.copies, f"{self.phase} outputs"):
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
        if is_size(value):
            return self.env[(value, copy if s.slot.get(value) == 2 else None)]
        if value in s.slot:
            return self.env[(s.members[2][s.offset[value]], copy)]
        if value in s.state:
            return self.env[(value, copy)]
        raise FoldError(f"{self.phase}: output {value.name} of block slot {label} is not a block node")


def _meta_without_tag(meta: dict) -> dict:
    out = dict(meta)
    custom = out.get("custom")
    if isinstance(custom, dict) and TAG in custom:
        rest = {k: v for k, v in custom.items() if k != TAG}
        if rest:
            out["custom"] = rest
        else:
            del out["custom"]
    return out


def _build(gm: fx.GraphModule, s: Slots, layout: Layout, phase: str, output_labels, rewrite_desc
           ) -> fx.GraphModule:
    builder = _Builder(s, layout, phase)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    labels = [s.slot_of(n) for n in nodes]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    try:
        for position, copy in expand_order(labels, layout.copies, f"{phase} graph"):
            builder.emit(nodes[position], copy)
        builder.write_output(output, output_labels(output, s), rewrite_desc)
    except KeyError as exc:   # the expanded order would read a node before making it
        raise FoldError(f"{phase}: a copied node reads {exc} before it is made") from None
    builder.graph.lint()
    return fx.GraphModule(gm, builder.graph)


def expand(fw: fx.GraphModule, bw: fx.GraphModule, layout: Layout) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward graphs of the full model from those of the four traced blocks."""
    sf = slots_of(fw, layout.state_slot)
    sb = slots_of(bw, layout.state_slot)
    check_repeats(fw, sf, "forward")
    check_repeats(bw, sb, "backward")

    def fw_labels(output: fx.Node, s: Slots) -> list[int | None]:
        return [s.slot_of(v) if isinstance(v, fx.Node) else None for v in output.args[0]]

    saved_count = [0]

    def fw_desc(desc, copy, position):
        if type(desc).__name__.startswith("SavedForBackwards"):   # numbered in order among the saved outputs
            saved_count[0] += 1
            return dataclasses.replace(desc, idx=saved_count[0] - 1)
        return desc

    def bw_labels(output: fx.Node, s: Slots) -> list[int | None]:
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
