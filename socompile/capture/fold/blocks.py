"""The repeated blocks of a model (one ``nn.ModuleList`` of identical blocks), and tracing blocks 0, 1, 2 and
n-1 of them with every node tagged by its slot (0..3)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterator

from torch import nn

log = logging.getLogger(__name__)

MIN_BLOCKS = 6        # folding 5 or fewer blocks saves too little to be worth a second code path
KEPT = 4              # slots traced: blocks 0, 1, 2 and n-1; slot 2 is the template of the copies
TAG = "socompile_fold_slot"   # the key of a node's slot in node.meta["custom"]


class FoldError(RuntimeError):
    """The traced graphs do not repeat as folding needs; the caller traces every block instead."""


@dataclasses.dataclass(frozen=True)
class Blocks:
    path: str             # module path of the ModuleList, e.g. "layers"
    count: int


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
            stack.enter_context(fx_traceback.annotate({TAG: slot}))
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
