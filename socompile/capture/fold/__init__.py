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

The parts: blocks.py finds the repeated blocks and traces four of them, each node tagged with its slot;
slots.py reads the slots back and checks that slots 1 and 2 repeat; order.py places the copies of slot 2 in
the execution order; layout.py maps the traced inputs to the full model's; rebuild.py writes the full graphs.
"""
from .blocks import Blocks, FoldError, find_blocks, traced_subset
from .layout import layout_for
from .rebuild import expand

__all__ = ["Blocks", "FoldError", "expand", "find_blocks", "layout_for", "traced_subset"]
