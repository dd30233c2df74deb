"""Pass: the forward waits for a stationary bucket's uploaded weights right before it first reads them.

With a separate host master (runtime/flat_bucket.py) each stationary bucket's updated weights are uploaded on
the "h2d" stream as soon as the bucket's step is final. Instead of making the compute stream wait for every
upload at the end of ``opt.step()``, the forward waits for each bucket's upload only where it first needs it,
so the uploads of later layers overlap the forward of earlier ones. Pattern inserted per stationary bucket b
(optimizer on the CPU, separate host master) whose parameters the forward reads::

    ... forward nodes that read no parameter of b ...
    socompile.wait_upload(claim, b, [p_1, ..., p_k])      # p_i: b's parameter placeholders
    ... first reader of any p_i, then the rest ...

``wait_upload`` declares that it mutates ``[p_1..p_k]`` (it writes nothing): that is the data edge that orders
every later reader of those parameters after it, in the FX interpreter and under Inductor alike (see
ops/offload_ops.py). On the CPU build an upload is a plain copy done at commit, so the op does nothing at run
time; on CUDA it queues ``compute.wait_event(upload_event)`` once per upload (no host block). Buckets that get
the op are marked ``graph_waits_upload``; ``opt.step()`` makes the compute stream wait for all the others.
"""
from __future__ import annotations

import torch
from torch import fx

from ..ops import offload_ops  # noqa: F401  (registers socompile::wait_upload)

PASS_NAME = "wait_uploads"


def _parameter_placeholders(gm: fx.GraphModule, ctx, params: set[str]) -> list[fx.Node]:
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        data = ctx.ir.graph.nodes.get(f"fw:{node.name}")
        if data is not None and data.get("alias_of") in params:
            out.append(node)
    return out


def wait_uploads(gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    runtime = ctx.offload
    if runtime is None or ctx.claim_handle < 0:
        return gm   # planned for reading only (offline plan/dump): no optimizer, no uploads
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    waits = []
    for b in plan.buckets:
        flat = runtime.buckets[b.index]
        if not (getattr(flat, "mirror", False) and flat.weights is not None and not flat.flow
                and flat.site == "cpu"):
            continue   # shared master (the weights are the master), flow (fetched), or stepped on the device
        holders = _parameter_placeholders(gm, ctx, set(b.params))
        readers = [u for h in holders for u in h.users if u.op != "output"]
        if not readers:
            continue   # the forward reads none of b's weights: opt.step() makes compute wait for its upload
        waits.append((min(position[r] for r in readers), b, flat, holders))
    for rank, (first, b, flat, holders) in enumerate(sorted(waits, key=lambda w: (w[0], w[1].index))):
        anchor = next(n for n in gm.graph.nodes if position.get(n) == first)
        with gm.graph.inserting_before(anchor):
            node = gm.graph.call_function(torch.ops.socompile.wait_upload.default,
                                          (ctx.claim_handle, b.index, holders))
        node.meta["val"] = None
        node.meta["stack_trace"] = anchor.meta.get("stack_trace")
        node.meta["socompile"] = {"pass": PASS_NAME,
                                  "why": f"bucket {b.index} ({b.layers}) is stationary with a separate host master: "
                                         f"its updated weights must have arrived before this first read"}
        flat.read_first_by_graph(rank)
    return gm
