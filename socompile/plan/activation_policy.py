"""Decision 3 of the planner: per repeated layer, keep, recompute (the whole layer, or "selective": all but its
attention kernels, whose outputs are kept) or offload its saved activations (docs/planner.md,
docs/activations.md). ``_activation_policy`` returns the search state with the layers' choices, their
activation bytes and offloaded bytes (a new one: the caller's is not changed), and writes its decision line."""
from __future__ import annotations

import dataclasses

import sympy

from ..dtypes import dtype_name
from ..units import human_bytes
from .memory import host_memory
from .plan import ACTIVATION_CHOICES
from .placement import simulated_step
from .search_state import HOST_HEADROOM, PlanError, _compact_buckets, _Context, _device

X = "selective_offload"
# 'auto' simulates this many of its candidate mixes (the best by its estimate). Each costs one simulated step
# (and a K=0 placement), about a tenth of a second on a 13B graph; 4 covers the mixes that differ in the few
# layers where the estimate's per-layer sums and the simulated overlaps disagree, at less than half again the
# planning time.
SIMULATED_CANDIDATES = 4


@dataclasses.dataclass(frozen=True)
class _LayerCosts:
    """Per layer name, the seconds each choice adds to the step (the policy's estimate), and the link times of
    an offload (out, in, forward hiding it, backward hiding it) for the decision line."""
    recompute: dict[str, float]
    selective: dict[str, float]
    offload: dict[str, float]
    selective_offload: dict[str, float]
    link: dict[str, tuple[float, float, float, float]]

    def seconds(self, choice: str, name: str) -> float:
        return 0.0 if choice == "keep" else getattr(self, choice)[name]


def _layer_costs(ctx: _Context, layers: list) -> _LayerCosts:
    """Recompute = the layer's forward (and its all-to-alls under Ulysses) again in backward; selective = the
    same less its attention kernels; offload = the link time not hidden by the compute it overlaps (the next
    layer's forward for the copy out, its backward for the copy in); selective_offload = selective + the
    offload cost of its checkpoints."""
    costs, cost, n = ctx.costs, ctx.cost, len(layers)
    a2a = {}
    if ctx.sp > 1:
        from ..perf.simulate import ulysses_bytes
        per = ulysses_bytes(costs, ctx.sp)
        for lc in layers:
            sent = sum(b for pos, b in zip(costs.fw_attention, per) if lc.fw_span[0] <= pos < lc.fw_span[1])
            a2a[lc.name] = float(cost.all_to_all_time(sent, ctx.sp))
    rec_cost = {lc.name: lc.fw_time + a2a.get(lc.name, 0.0) for lc in layers}
    # Selective re-runs the layer's forward but its attention kernels; under Ulysses both all-to-alls again
    # (q, k, v in head layout for the attention backward; the output in sequence layout for w_o's backward).
    sel_cost = {lc.name: max(0.0, lc.fw_time - lc.attention_time) + a2a.get(lc.name, 0.0) for lc in layers}
    off_cost, link = {}, {}
    for i, lc in enumerate(layers):
        out_t = float(cost.transfer_time(lc.moved, "d2h"))
        in_t = float(cost.transfer_time(lc.moved, "h2d"))
        hide_fw = layers[i + 1].fw_time if i + 1 < n else 0.0
        hide_bw = layers[i + 1].bw_time if i + 1 < n else 0.0
        link[lc.name] = (out_t, in_t, hide_fw, hide_bw)
        off_cost[lc.name] = max(0.0, out_t - hide_fw) + max(0.0, in_t - hide_bw)
    # selective_offload: selective, and its checkpoints (output = next input, attention outputs) cross the link
    ck_cost = {}
    for i, lc in enumerate(layers):
        _, _, hide_fw, hide_bw = link[lc.name]
        ck = _checkpoint_bytes(lc)
        ck_cost[lc.name] = sel_cost[lc.name] + max(0.0, float(cost.transfer_time(ck, "d2h")) - hide_fw) + \
            max(0.0, float(cost.transfer_time(ck, "h2d")) - hide_bw)
    return _LayerCosts(rec_cost, sel_cost, off_cost, ck_cost, link)


def _activation_room(ctx: _Context, base) -> tuple[float, float]:
    """(device bytes left for activations, host bytes left for offloaded ones) once the rest of the plan takes
    the least it can: every bucket on the CPU, every bucket that can stream (uses in one interval,
    _compact_buckets) streamed at distance 1, in bf16."""
    compact = _compact_buckets(ctx, base)
    reachable = [dataclasses.replace(b, weight_mode="flow", prefetch_distance=1, cast_site="cpu",
                                     param_link_dtype=dtype_name(ctx.weight_bytes)) if b.index in compact else b
                 for b in base]
    fixed = _device(ctx, reachable).device_peak - ctx.activations
    return ctx.budget - fixed, _host_room(ctx, base)


def _activation_policy(ctx: _Context, base, decisions: list[str]) -> tuple[_Context, str]:
    """Per repeated layer: keep, recompute, selective, selective_offload or offload its saved activations.
    Returns (``ctx`` with ``choices``, ``activations``, ``activations_expr`` and ``offloaded_bytes`` of those
    choices, Plan.recompute): "none" (every layer keeps; ``ctx`` as given) or "layers".

    Memory (per rank): activations = peak - sum(saved of non-kept layers) + sum(input of recomputed and
    selective layers) + sum(attention outputs of selective layers) + the largest non-kept layer's saved tensors
    (live while it is recomputed or used) + the largest offloaded layer's again (a window of two: one in use,
    the next one in flight). Cost: recompute = the layer's forward (and its all-to-alls under Ulysses) again in
    backward; selective = the same less its attention kernels (their outputs are kept: at long sequences
    attention is most of a layer's forward and its outputs are about one layer input); offload = the link time
    not hidden by the compute it overlaps (the next layer's forward for the copy out, the previous backward for
    the copy in), host memory (pinned) for its saved tensors; selective_offload = selective + the offload cost
    of its checkpoints (output and attention outputs) instead of its saved tensors. 'auto': see _AutoSearch."""
    layers = list(ctx.costs.layers)
    forced = ctx.options.activations
    pins = _option_pins(ctx, layers)
    if not layers:
        if forced in ("recompute", "selective", X, "offload"):
            decisions.append(f"activations: {forced} requested but the graph has no repeated layers; kept")
        return ctx, "none"
    available, room = _activation_room(ctx, base)
    lcosts = _layer_costs(ctx, layers)
    simulated = ""
    if ctx.pinned_choices is not None:
        chosen, forced = _pinned_choices(ctx, layers), "pinned"
    elif forced == "auto":
        chosen, simulated = _auto_choices(ctx, layers, lcosts, available, room, base)
    else:
        chosen = _forced_choices(ctx, layers, forced, room)
    chosen.update(pins)
    act, expr, offloaded = _activation_bytes(ctx, chosen)
    if all(c == "keep" for c in chosen.values()):
        if forced == "keep":
            decisions.append("activations: every layer keeps its activations (options.activations='keep')")
        return ctx, "none"
    ctx = dataclasses.replace(ctx, activations=act, activations_expr=expr, offloaded_bytes=offloaded,
                              choices=tuple((lc.name, chosen[lc.name]) for lc in layers))
    decisions.append(_activation_line(ctx, layers, chosen, lcosts, available, room, forced, simulated))
    return ctx, "layers"


def _pinned_choices(ctx: _Context, layers: list) -> dict[str, str]:
    """The caller's per-layer choices (unnamed layers keep), checked against the graph's layers."""
    given = dict(ctx.pinned_choices)
    unknown = sorted(set(given) - {lc.name for lc in layers})
    bad = {k: v for k, v in given.items() if v not in ACTIVATION_CHOICES}
    if unknown or bad:
        raise PlanError(f"pinned activation choices name unknown layers {unknown} or choices {bad}; layers: "
                        f"{_names_text([lc.name for lc in layers])}, choices {'/'.join(ACTIVATION_CHOICES)}")
    return {lc.name: given.get(lc.name, "keep") for lc in layers}


def _forced_choices(ctx: _Context, layers: list, forced: str, room: float) -> dict[str, str]:
    """options.activations names one choice for every layer; an offload must fit host memory."""
    if forced in ("offload", X):
        need = sum(lc.moved if forced == "offload" else _checkpoint_bytes(lc) for lc in layers)
        if need > room:
            raise PlanError(f"activations={forced!r} needs {human_bytes(need)} of host memory for the saved "
                            f"activations of {len(layers)} layers but only {human_bytes(room)} is left after the "
                            f"optimizer state ({ctx.hw.name}, {HOST_HEADROOM:.0%} usable); use "
                            f"activations='auto' (offloads what fits, recomputes the rest) or 'recompute'")
    return {lc.name: forced for lc in layers}


def _auto_choices(ctx: _Context, layers: list, lcosts: _LayerCosts, available: float, room: float,
                  base) -> tuple[dict[str, str], str]:
    """options.activations='auto': keep everything if it fits; else, of _AutoSearch's candidate mixes that save
    memory (checkpointing that saves nothing keeps everything), the best SIMULATED_CANDIDATES by the policy's
    estimate are each replayed by the simulator (placement.simulated_step) and the fastest simulated step that
    fits wins (ties: the better estimate). The estimate sums per-layer costs; the step overlaps them with the
    link (weight flow and offloads share it), the CPU tail and each other, so its order can differ.
    Returns (choices, what the decision line says of the simulation)."""
    keep = {lc.name: "keep" for lc in layers}
    if _activation_bytes(ctx, keep)[0] <= available:
        return keep, ""
    search = _AutoSearch(ctx, layers, lcosts, available, room)
    found = [c for c in search.candidates(SIMULATED_CANDIDATES)
             if _activation_bytes(ctx, c)[0] < ctx.costs.activation_peak]
    if len(found) <= 1:   # nothing to compare: the GPU-bucket search simulates this one anyway
        return (found[0] if found else keep), ""
    order_cache: dict = {}
    steps = [simulated_step(ctx, base, c, *_activation_bytes(ctx, c), order_cache) for c in found]
    fits = [i for i, t in enumerate(steps) if t is not None]
    if not fits:
        return found[0], ""
    best = min(fits, key=lambda i: (steps[i], i))
    first = "" if best == 0 else f", the estimate's best {steps[0]:.4g} s" if steps[0] is not None else \
        ", the estimate's best does not fit"
    note = f"; the fastest simulated step of the {len(found)} best mixes by estimate: {steps[best]:.4g} s{first}"
    return found[best], note


class _AutoSearch:
    """For each number of kept layers (the last ones: their backward comes first), each number of offloads that fits
    where offload is cheaper than recompute, then recomputed layers made selective while the device holds their
    attention outputs (most time saved per byte first), then the layers still recomputed made selective_offload
    where host memory holds their checkpoints (and back to selective where the device memory that frees allows);
    candidates() ranks these by the least recompute/offload time (ties: more layers kept)."""

    def __init__(self, ctx: _Context, layers: list, lcosts: _LayerCosts, available: float, room: float):
        self.ctx, self.layers, self.costs, self.available, self.room = ctx, layers, lcosts, available, room
        self.max_offloads = sum(1 for _ in _prefix_within(sorted(lc.moved for lc in layers), room))

    def candidates(self, count: int) -> list[dict[str, str]]:
        """Up to ``count`` distinct mixes, the cheapest by the estimate first (ties: more layers kept). Most
        layers kept first; for each count, every number of offloads that fits, most first (an offloaded layer
        frees its input but the two-layer window costs device memory once, so fewer may fit better; and each
        offload takes device room that selective layers and host room that checkpoints could use: at 1M tokens
        no offloads and every layer selective, its checkpoints in host memory, costs a fifth of the most
        offloads), each then given selective layers in the room left. Stop once no fewer keeps can beat the
        ``count``-th cheapest found."""
        n = len(self.layers)
        found: list[tuple[float, int, dict[str, str]]] = []
        for n_keep in range(n - 1, -1, -1):
            if len(found) >= count and self.lower_bound(n_keep) >= found[count - 1][0]:
                break
            for max_offload in range(n - n_keep, -1, -1):
                trial = self.assign(n_keep, max_offload)
                need = _activation_bytes(self.ctx, trial)[0]
                if need <= self.available:
                    trial = self.to_host(self.upgrade(trial, self.available - need))
                    if all(trial != c for _, _, c in found):
                        found.append((self.spent(trial), -n_keep, trial))
                        found.sort(key=lambda f: f[:2])
                if "offload" not in trial.values():
                    break
        return [c for _, _, c in found[:count]] or [self.assign(0, 0)]

    def assign(self, n_keep: int, max_offload: int) -> dict[str, str]:
        """The last ``n_keep`` layers kept; of the others, up to ``max_offload`` offloaded where that is cheaper
        than recompute and host memory holds them (largest gain first), the rest recomputed."""
        layers, rec_cost, off_cost, n = self.layers, self.costs.recompute, self.costs.offload, len(self.layers)
        choice = {lc.name: "keep" for lc in layers[n - n_keep:]}
        others = sorted(layers[:n - n_keep], key=lambda lc: (-(rec_cost[lc.name] - off_cost[lc.name]),
                                                             layers.index(lc)))
        used, count = 0.0, 0
        for lc in others:
            if off_cost[lc.name] < rec_cost[lc.name] and used + lc.moved <= self.room and count < max_offload:
                choice[lc.name] = "offload"
                used += lc.moved
                count += 1
            else:
                choice[lc.name] = "recompute"
        return choice

    def upgrade(self, choice: dict[str, str], headroom: float) -> dict[str, str]:
        """Recomputed layers made selective, most time saved per byte kept first, while ``headroom`` (device
        bytes) holds their attention outputs (each adds exactly its attention outputs to both moments of
        _activation_bytes)."""
        layers, rec_cost, sel_cost = self.layers, self.costs.recompute, self.costs.selective
        gain = {lc.name: rec_cost[lc.name] - sel_cost[lc.name] for lc in layers}
        candidates = sorted((lc for lc in layers if choice[lc.name] == "recompute" and gain[lc.name] > 0),
                            key=lambda lc: (-gain[lc.name] / max(lc.attention_saved, 1.0), layers.index(lc)))
        out = dict(choice)
        for lc in candidates:
            if lc.attention_saved <= headroom:
                out[lc.name] = "selective"
                headroom -= lc.attention_saved
        return out

    def to_host(self, choice: dict[str, str]) -> dict[str, str]:
        """Layers still recomputed whole become selective_offload where that is cheaper and host memory holds
        their checkpoints (next to the offloaded layers'); then, where the device memory this frees holds them,
        selective again (the same time, no link traffic, no host memory). Unchanged if it would not fit."""
        layers, rec_cost, sel_cost, ck_cost = (self.layers, self.costs.recompute, self.costs.selective,
                                               self.costs.selective_offload)
        used = sum(lc.moved for lc in layers if choice[lc.name] == "offload")
        out = dict(choice)
        for lc in layers:
            if out[lc.name] == "recompute" and ck_cost[lc.name] < rec_cost[lc.name] and \
                    used + _checkpoint_bytes(lc) <= self.room:
                out[lc.name] = X
                used += _checkpoint_bytes(lc)
        if out == choice:
            return choice
        need = _activation_bytes(self.ctx, out)[0]
        if need > self.available:
            return choice
        for lc in layers:
            if out[lc.name] == X and sel_cost[lc.name] <= ck_cost[lc.name]:
                trial = {**out, lc.name: "selective"}
                more = _activation_bytes(self.ctx, trial)[0]
                if more > self.available:
                    break
                out = trial
        return out

    def spent(self, choice: dict[str, str]) -> float:
        """Seconds the choice adds to the step (the policy's estimate)."""
        return sum(self.costs.seconds(c, name) for name, c in choice.items())

    def lower_bound(self, n_keep: int) -> float:
        """No choice with n_keep kept layers spends less: every other layer at its cheapest, offloads (the
        largest gains) limited by what host memory can hold. Grows as n_keep falls."""
        layers, rec_cost, sel_cost = self.layers, self.costs.recompute, self.costs.selective
        cheap = [min(rec_cost[lc.name], sel_cost[lc.name]) for lc in layers[:len(layers) - n_keep]]
        gains = sorted((max(0.0, c - self.costs.offload[lc.name]) for c, lc in zip(cheap, layers)), reverse=True)
        return sum(cheap) - sum(gains[:self.max_offloads])


def _checkpoint_bytes(lc) -> float:
    """What a selective_offload layer sends to host memory: its output (the next layer's input, as large as its
    own) and its attention outputs."""
    return lc.boundary + lc.attention_saved


def _checkpoint_expr(lc):
    return lc.boundary_expr + lc.attention_saved_expr


def _prefix_within(sizes: list[float], limit: float):
    """The leading items of ``sizes`` whose running sum stays within ``limit``."""
    total = 0.0
    for s in sizes:
        total += s
        if total > limit:
            return
        yield s


def _activation_bytes(ctx: _Context, chosen: dict[str, str]) -> tuple[float, object, float]:
    """(device activation bytes, the same as a formula, host bytes offloaded) of a per-layer choice: the larger
    of two moments.
    - at the keep-everything peak (usually the loss backward): peak - saved of non-kept layers + inputs of
      recomputed and selective layers + attention outputs of selective layers (+ the first offloaded layer
      coming back);
    - during a non-kept layer's backward: saved tensors still kept (kept layers, tensors outside the layers)
      + inputs of recomputed and selective layers + attention outputs of selective layers + that layer's saved
      tensors (recomputed or fetched; a selective layer's attention outputs are already counted) + the next
      offloaded layer in flight + two layer-input-sized activation gradients."""
    costs = ctx.costs
    nonkeep = [lc for lc in costs.layers if chosen.get(lc.name, "keep") != "keep"]
    if not nonkeep:
        return costs.activation_peak, costs.activation_peak_expr, 0.0
    recomputed = [lc for lc in nonkeep if chosen[lc.name] in ("recompute", "selective")]
    selective = [lc for lc in nonkeep if chosen[lc.name] == "selective"]
    offloaded = [lc for lc in nonkeep if chosen[lc.name] == "offload"]
    to_host = [lc for lc in nonkeep if chosen[lc.name] == "selective_offload"]

    def rebuilt(lc):   # what a non-kept layer's backward brings back beyond what stays saved
        return lc.saved - lc.attention_saved if chosen[lc.name] == "selective" else lc.saved

    biggest = max(nonkeep, key=rebuilt)
    # the largest layer in flight (a window of two): an offloaded layer's saved tensors or checkpoints
    flights = [(lc.saved, lc.saved_expr) for lc in offloaded] + [(_checkpoint_bytes(lc), _checkpoint_expr(lc))
                                                                 for lc in to_host]
    in_flight = [max(flights, key=lambda f: f[0])[1]] if flights else []
    widest = max(costs.layers, key=lambda lc: lc.boundary)
    common = [-lc.saved_expr for lc in nonkeep] + [lc.boundary_expr for lc in recomputed] + \
        [lc.attention_saved_expr for lc in selective] + in_flight
    at_peak = [costs.activation_peak_expr] + common
    extra = biggest.saved_expr - biggest.attention_saved_expr if chosen[biggest.name] == "selective" \
        else biggest.saved_expr
    in_layer = [costs.saved_expr] + common + [extra, 2 * widest.boundary_expr]

    def value(terms):
        return sum(ctx.cost.value(t) if not isinstance(t, (int, float)) else t for t in terms)

    terms = max((at_peak, in_layer), key=value)
    if all(isinstance(t, (int, float)) for t in terms):
        expr = sum(terms)
    else:
        expr = sympy.expand(sympy.Add(*[sympy.sympify(t) for t in terms]))
    return value(terms), expr, float(sum(lc.moved for lc in offloaded) + sum(_checkpoint_bytes(lc) for lc in to_host))


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


def _option_pins(ctx: _Context, layers) -> dict[str, str]:
    """options.activation_layers (layer group -> choice), each name checked against the graph's repeated layers:
    these layers take the given choice whatever the policy picks for the others."""
    pins = ctx.options.activation_layers or {}
    unknown = sorted(set(pins) - {lc.name for lc in layers})
    if unknown:
        raise PlanError(f"option activation_layers names {unknown}, which are not repeated layers of this graph; "
                        f"its layers: {_names_text([lc.name for lc in layers])}")
    return dict(pins)


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


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _pinned_text(ctx, room) -> str:
    return f"{human_bytes(ctx.offloaded_bytes)} pinned host memory of {human_bytes(room)} free"


def _offload_reason(group, ctx, lcosts: _LayerCosts, room, forced) -> str:
    lc = max(group, key=lambda x: x.moved)   # the largest layer: its link times are the longest
    out_t, in_t, hide_fw, hide_bw = lcosts.link[lc.name]
    link = f"{_ms(out_t)} out under {_ms(hide_fw)} of forward, {_ms(in_t)} in under {_ms(hide_bw)} of backward"
    exposed = f"{_ms(lcosts.offload[lc.name])} exposed vs {_ms(lcosts.recompute[lc.name])} to recompute"
    return f"{human_bytes(lc.moved)} each way per layer, {link}: {exposed}; {_pinned_text(ctx, room)}"


def _selective_reason(group, ctx, lcosts: _LayerCosts, room, forced) -> str:
    lc = group[0]
    forced_note = f"; options.activations={forced!r}" if forced == "selective" else ""
    return (f"+{_ms(lcosts.selective[lc.name])} each in backward instead of {_ms(lcosts.recompute[lc.name])} "
            f"(attention {_ms(lc.attention_time)} not re-run), keeps {human_bytes(lc.boundary + lc.attention_saved)}: "
            f"input and attention outputs{forced_note}")


def _selective_offload_reason(group, ctx, lcosts: _LayerCosts, room, forced) -> str:
    lc = group[0]
    checkpoints = f"its {human_bytes(_checkpoint_bytes(lc))} of checkpoints (output, attention outputs) in host memory"
    return (f"as selective, {checkpoints}, +{_ms(lcosts.selective_offload[lc.name])} each in backward with the link "
            f"time not hidden; {_pinned_text(ctx, room)}")


def _recompute_reason(group, ctx, lcosts: _LayerCosts, room, forced) -> str:
    lc = group[0]
    rec, off, sel = lcosts.recompute[lc.name], lcosts.offload[lc.name], lcosts.selective[lc.name]
    why = ("options.activations='recompute'" if forced == "recompute" else
           "host memory for offload used up" if off < rec and room < lc.moved + ctx.offloaded_bytes else
           f"offload is cheaper but its two-layer window ({human_bytes(2 * lc.saved)}) does not fit the device "
           f"beside the other layers' inputs" if off < rec else
           f"offload would expose {_ms(off)} > {_ms(rec)}")
    if forced == "auto" and sel < rec:
        why += f"; selective would keep {human_bytes(lc.attention_saved)} more per layer, which does not fit"
    return f"+{_ms(rec)} each in backward, keeps {human_bytes(lc.boundary)} input; {why}"


# Each choice but keep, in the order the decision line lists them, and what it says of the layers taking it.
_CHOICE_REASONS = (("offload", _offload_reason), ("selective", _selective_reason),
                   ("selective_offload", _selective_offload_reason), ("recompute", _recompute_reason))


def _activation_line(ctx, layers, chosen, lcosts: _LayerCosts, available, room, forced, simulated="") -> str:
    groups = {c: [lc for lc in layers if chosen[lc.name] == c]
              for c in ("keep", "offload", "selective", "selective_offload", "recompute")}
    parts = [f"keep {len(groups['keep'])} of {len(layers)} ({_names_text([lc.name for lc in groups['keep']])})"]
    for choice, reason in _CHOICE_REASONS:
        group = groups[choice]
        if group:   # 'offload 11 (layers.0..10: why)': the choice, how many layers take it, which, and why
            parts.append(f"{choice} {len(group)} ({_names_text([lc.name for lc in group])}: "
                         f"{reason(group, ctx, lcosts, room, forced)})")
    source = "pinned by the caller" if forced == "pinned" else f"options.activations={forced!r}" if forced != "auto" else (
        f"auto: all-keep needs {human_bytes(ctx.costs.activation_peak)}, {human_bytes(available)} left for "
        f"activations with every weight streamed{simulated}")
    return (f"activations: {', '.join(parts)}; device activations {human_bytes(ctx.activations)} ({source})")
