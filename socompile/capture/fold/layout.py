"""How the traced model's inputs (the parameters and buffers of blocks 0, 1, 2, n-1, then the rest) map to the
full model's, copied blocks included."""
from __future__ import annotations

import dataclasses

from .blocks import KEPT, Blocks, FoldError, kept_indices


@dataclasses.dataclass
class Layout:
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


def layout_for(traced_names: list[str], full_names: list[str], blocks: Blocks, n_other_inputs: int) -> Layout:
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
    return Layout(count=blocks.count, state_slot=state_slot, new_index=new_index, copy_index=copy_index)
