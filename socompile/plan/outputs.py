"""What the compiled forward hands back to the caller, and what a loss computed outside it holds on the device.

The plan counts the graphs it is given. When the graph returns logits and the caller computes the loss, the
logits stay alive under the caller's reference and the loss's own temporaries (a cross-entropy casts them to
fp32 and keeps its log-softmax for the backward, then makes their gradients) sit beside everything planned:
on an H200, a 0.37B Llama at 2 x 1024 tokens peaked at 128% of its plan that way (docs/runtime.md)."""
from __future__ import annotations

from ..dtypes import dtype_bytes
from ..units import human_bytes

# Returned tensors below this size are losses and metrics, not logits: nothing worth a line in the report.
SMALL_OUTPUT_BYTES = 2**20
# A cross-entropy outside the graph: the fp32 copy of the logits, its log-softmax (saved) and the gradient of
# each (the copy is freed after the forward; the rest meet at the start of backward): about 3 fp32 copies.
OUTSIDE_LOSS_FP32_COPIES = 3


def returned_outputs(ir) -> list[str]:
    """Forward nodes the graph returns to the caller (the saved tensors it hands to the backward excluded)."""
    g = ir.graph
    output = next((k for k in ir.fw_order if g.nodes[k]["kind"] == "output"), None)
    if output is None:
        return []
    return [p for p in g.predecessors(output) if f"bw:{p[3:]}" not in g]


def outside_loss_note(ir, cost) -> str | None:
    """A report line when the graph returns large tensors (logits) rather than a loss; else None."""
    g = ir.graph
    big = [k for k in returned_outputs(ir) if cost.value(g.nodes[k]["bytes"]) >= SMALL_OUTPUT_BYTES]
    if not big:
        return None
    held = sum(cost.value(g.nodes[k]["bytes"]) for k in big)
    fp32 = sum(cost.value(g.nodes[k]["bytes"]) * 4 / dtype_bytes(str(g.nodes[k].get("dtype", "")).removeprefix(
        "torch.")) for k in big)
    return (f"outputs: the graph returns {human_bytes(held)} to the caller ({len(big)} tensor(s), not a loss); a "
            f"loss computed outside the compiled graph holds them and its temporaries (a cross-entropy: about "
            f"{human_bytes(OUTSIDE_LOSS_FP32_COPIES * fp32)}) beyond this plan's device peak; compile the loss "
            f"with the model (socompile.models.WithLMLoss) to have it planned")

