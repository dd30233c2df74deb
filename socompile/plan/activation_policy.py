"""Decision 3 of the planner: per repeated layer, keep, recompute or offload its saved activations
(docs/planner.md, docs/activations.md). ``_activation_policy`` sets ``ctx.choices``, ``ctx.activations`` and
``ctx.offloaded_bytes`` and writes its decision line."""
from __future__ import annotations

import dataclasses

import sympy

from .context import HOST_HEADROOM, PlanError, _compact_buckets, _Context, _device, _dtype_name
from .hardware import GB
from .memory import host_memory


def _activation_policy(ctx: _Context, base, decisions: list[str]) -> str:
    """Per repeated layer: keep, recompute or offload its saved activations (sets ctx.choices, ctx.activations,
    ctx.offloaded_bytes; returns Plan.recompute).

    Memory (per rank): activations = peak - sum(saved of non-kept layers) + sum(input of recomputed layers)
    + the largest non-kept layer's saved tensors (live while it is recomputed or used) + the largest offloaded
    layer's again (a window of two: one in use, the next one in flight). Cost: recompute = the layer's forward
    (and its all-to-alls under Ulysses) again in backward; offload = the link time not hidden by the compute it
    overlaps (the next layer's forward for the copy out, the previous backward for the copy in), host memory
    (pinned) for its saved tensors. 'auto': keep the most layers that fit (the last ones: their backward comes
    first), then offload where it is cheaper than recompute and host memory allows, recompute the rest."""
    costs, cost = ctx.costs, ctx.cost
    layers = list(costs.layers)
    forced = ctx.options.activations
    if not layers:
        if forced in ("recompute", "offload"):
            decisions.append(f"activations: {forced} requested but the graph has no repeated layers; kept")
        return "none"
    # The least the rest of the plan can take: every bucket on the CPU, every bucket that can stream (uses in
    # one interval, _compact_buckets) streamed at distance 1, in bf16.
    compact = _compact_buckets(ctx, base)
    reachable = [dataclasses.replace(b, weight_mode="flow", prefetch_distance=1, cast_site="cpu",
                                     param_link_dtype=_dtype_name(ctx.weight_bytes)) if b.index in compact else b
                 for b in base]
    fixed = _device(ctx, reachable).device_peak - ctx.activations
    available = ctx.budget - fixed
    room = _host_room(ctx, base)
    n = len(layers)
    a2a = {}
    if ctx.sp > 1:
        from .simulate import ulysses_bytes
        per = ulysses_bytes(costs, ctx.sp)
        for lc in layers:
            sent = sum(b for pos, b in zip(costs.fw_attention, per) if lc.fw_span[0] <= pos < lc.fw_span[1])
            a2a[lc.name] = float(cost.all_to_all_time(sent, ctx.sp))
    rec_cost = {lc.name: lc.fw_time + a2a.get(lc.name, 0.0) for lc in layers}
    off_cost, link = {}, {}
    for i, lc in enumerate(layers):
        out_t = float(cost.transfer_time(lc.saved, "d2h"))
        in_t = float(cost.transfer_time(lc.saved, "h2d"))
        hide_fw = layers[i + 1].fw_time if i + 1 < n else 0.0
        hide_bw = layers[i + 1].bw_time if i + 1 < n else 0.0
        link[lc.name] = (out_t, in_t, hide_fw, hide_bw)
        off_cost[lc.name] = max(0.0, out_t - hide_fw) + max(0.0, in_t - hide_bw)

    def assign(n_keep: int, max_offload: int) -> dict[str, str]:
        choice = {lc.name: "keep" for lc in layers[n - n_keep:]}
        others = sorted(layers[:n - n_keep], key=lambda lc: (-(rec_cost[lc.name] - off_cost[lc.name]),
                                                             layers.index(lc)))
        used, count = 0.0, 0
        for lc in others:
            if off_cost[lc.name] < rec_cost[lc.name] and used + lc.saved <= room and count < max_offload:
                choice[lc.name] = "offload"
                used += lc.saved
                count += 1
            else:
                choice[lc.name] = "recompute"
        return choice

    if ctx.pinned_choices is not None:
        given = dict(ctx.pinned_choices)
        unknown = sorted(set(given) - {lc.name for lc in layers})
        bad = {k: v for k, v in given.items() if v not in ("keep", "recompute", "offload")}
        if unknown or bad:
            raise PlanError(f"pinned activation choices name unknown layers {unknown} or choices {bad}; layers: "
                            f"{_names_text([lc.name for lc in layers])}, choices keep/recompute/offload")
        chosen = {lc.name: given.get(lc.name, "keep") for lc in layers}
        forced = "pinned"
    elif forced == "auto":
        chosen = {lc.name: "keep" for lc in layers}
        if _activation_bytes(ctx, chosen)[0] > available:
            # Most layers kept first; for each count, the most offloads that still fit (an offloaded layer
            # frees its input but the two-layer window costs device memory once, so fewer may fit better).
            found = None
            for n_keep in range(n - 1, -1, -1):
                for max_offload in range(n - n_keep, -1, -1):
                    trial = assign(n_keep, max_offload)
                    if _activation_bytes(ctx, trial)[0] <= available:
                        found = trial
                        break
                    if "offload" not in trial.values():
                        break
                if found:
                    break
            chosen = found or assign(0, 0)
            if _activation_bytes(ctx, chosen)[0] >= costs.activation_peak:   # checkpointing saves nothing
                chosen = {lc.name: "keep" for lc in layers}
    else:
        chosen = {lc.name: forced for lc in layers}
        if forced == "offload":
            need = sum(lc.saved for lc in layers)
            if need > room:
                raise PlanError(f"activations='offload' needs {need / GB:.1f} GB of host memory for the saved "
                                f"activations of {n} layers but only {room / GB:.1f} GB is left after the "
                                f"optimizer state ({ctx.hw.name}, {HOST_HEADROOM:.0%} usable); use "
                                f"activations='auto' (offloads what fits, recomputes the rest) or 'recompute'")
    act, expr, offloaded = _activation_bytes(ctx, chosen)
    if all(c == "keep" for c in chosen.values()):
        if forced == "keep":
            decisions.append("activations: every layer keeps its activations (options.activations='keep')")
        return "none"
    ctx.activations, ctx.activations_expr, ctx.offloaded_bytes = act, expr, offloaded
    ctx.choices = tuple((lc.name, chosen[lc.name]) for lc in layers)
    decisions.append(_activation_line(ctx, layers, chosen, rec_cost, off_cost, link, available, room, forced))
    return "layers"


def _activation_bytes(ctx: _Context, chosen: dict[str, str]) -> tuple[float, object, float]:
    """(device activation bytes, the same as a formula, host bytes offloaded) of a per-layer choice: the larger
    of two moments.
    - at the keep-everything peak (usually the loss backward): peak - saved of non-kept layers + inputs of
      recomputed layers (+ the first offloaded layer coming back);
    - during a non-kept layer's backward: saved tensors still kept (kept layers, tensors outside the layers)
      + inputs of recomputed layers + that layer's saved tensors (recomputed or fetched) + the next offloaded
      layer in flight + two layer-input-sized activation gradients."""
    costs = ctx.costs
    nonkeep = [lc for lc in costs.layers if chosen.get(lc.name, "keep") != "keep"]
    if not nonkeep:
        return costs.activation_peak, costs.activation_peak_expr, 0.0
    recomputed = [lc for lc in nonkeep if chosen[lc.name] == "recompute"]
    offloaded = [lc for lc in nonkeep if chosen[lc.name] == "offload"]
    biggest = max(nonkeep, key=lambda lc: lc.saved)
    in_flight = [max(offloaded, key=lambda lc: lc.saved)] if offloaded else []
    widest = max(costs.layers, key=lambda lc: lc.boundary)
    common = [-lc.saved_expr for lc in nonkeep] + [lc.boundary_expr for lc in recomputed] + \
        [lc.saved_expr for lc in in_flight]
    at_peak = [costs.activation_peak_expr] + common
    in_layer = [costs.saved_expr] + common + [biggest.saved_expr, 2 * widest.boundary_expr]

    def value(terms):
        return sum(ctx.cost.value(t) if not isinstance(t, (int, float)) else t for t in terms)

    terms = max((at_peak, in_layer), key=value)
    if all(isinstance(t, (int, float)) for t in terms):
        expr = sum(terms)
    else:
        expr = sympy.expand(sympy.Add(*[sympy.sympify(t) for t in terms]))
    return value(terms), expr, float(sum(lc.saved for lc in offloaded))


def _host_room(ctx: _Context, base) -> float:
    """Host bytes left for offloaded activations once every bucket's optimizer state is on the CPU (exact
    rollback if it fits, else the inverse) and every weight has a bf16 host copy (the most the plan can need)."""
    limit = ctx.hw.host_memory * HOST_HEADROOM
    flows = [dataclasses.replace(b, weight_mode="flow", prefetch_distance=1) for b in base]
    need = host_memory(flows, ctx.weight_bytes, ctx.world)[0]
    if need > limit:
        need = host_memory([dataclasses.replace(b, rollback="inverse") for b in flows], ctx.weight_bytes,
                           ctx.world)[0]
    return max(0.0, limit - need)


def _names_text(names: list[str]) -> str:
    """['layers.0', 'layers.1', 'layers.2', 'layers.5'] -> 'layers.0..2,5'."""
    if not names:
        return "-"
    nums, prefix = [], None
    for name in names:
        head, _, tail = name.rpartition(".")
        if not tail.isdigit() or (prefix is not None and head != prefix):
            return ",".join(names)
        prefix = head
        nums.append(int(tail))
    runs, start = [], nums[0]
    for a, b in zip(nums, nums[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}..{a}")
            start = b
    return f"{prefix}." + ",".join(runs)


def _activation_line(ctx, layers, chosen, rec_cost, off_cost, link, available, room, forced) -> str:
    groups = {c: [lc for lc in layers if chosen[lc.name] == c] for c in ("keep", "offload", "recompute")}
    parts = [f"keep {len(groups['keep'])} of {len(layers)} ({_names_text([lc.name for lc in groups['keep']])})"]
    if groups["offload"]:
        lc = max(groups["offload"], key=lambda x: x.saved)
        out_t, in_t, hide_fw, hide_bw = link[lc.name]
        parts.append(f"offload {len(groups['offload'])} ({_names_text([x.name for x in groups['offload']])}: "
                     f"{lc.saved / GB:.2f} GB each way per layer, {out_t * 1e3:.1f} ms out under "
                     f"{hide_fw * 1e3:.1f} ms of forward, {in_t * 1e3:.1f} ms in under {hide_bw * 1e3:.1f} ms of "
                     f"backward: {off_cost[lc.name] * 1e3:.1f} ms exposed vs {rec_cost[lc.name] * 1e3:.1f} ms to "
                     f"recompute; {ctx.offloaded_bytes / GB:.1f} GB pinned host memory of {room / GB:.1f} GB free)")
    if groups["recompute"]:
        lc = groups["recompute"][0]
        why = ("options.activations='recompute'" if forced == "recompute" else
               "host memory for offload used up" if off_cost[lc.name] < rec_cost[lc.name] and room < lc.saved
               + ctx.offloaded_bytes else
               f"offload is cheaper but its two-layer window ({2 * lc.saved / GB:.1f} GB) does not fit the device "
               f"beside the other layers' inputs" if off_cost[lc.name] < rec_cost[lc.name] else
               f"offload would expose {off_cost[lc.name] * 1e3:.1f} ms > {rec_cost[lc.name] * 1e3:.1f} ms")
        parts.append(f"recompute {len(groups['recompute'])} ({_names_text([x.name for x in groups['recompute']])}: "
                     f"+{rec_cost[lc.name] * 1e3:.1f} ms each in backward, keeps {lc.boundary / GB:.2f} GB input; "
                     f"{why})")
    source = "pinned by the caller" if forced == "pinned" else f"options.activations={forced!r}" if forced != "auto" else (
        f"auto: all-keep needs {ctx.costs.activation_peak / GB:.1f} GB, {available / GB:.1f} GB left for "
        f"activations with every weight streamed")
    return (f"activations: {', '.join(parts)}; device activations {ctx.activations / GB:.1f} GB ({source})")
