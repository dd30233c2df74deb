"""The planner: ``plan(ir, hw, options) -> Plan``. Pure and deterministic (same input, byte-identical JSON).

Decisions, in this order (each reads the cost model; docs/planner.md explains them with numbers):
1. Buckets: parameters in the order backward produces their gradients, ``options.bucket_size`` fp32 bytes each.
   Not pinned: 64 MB, or when that cannot fit the budget (the gradients and flow buffers of whole buckets live
   at once, plan/step_timeline.py), the largest smaller size (halving, down to the largest parameter) whose
   floor fits.
2. Casts and link precision: gradients cross in the model's own dtype (the CPU kernel reads bf16 directly, an
   fp32 upcast carries no information). Updated bf16/fp16 weights of stationary CPU buckets either cross as
   fp32 and are cast on the GPU, or are written as bf16 by the CPU kernel in its pass and cross as bf16: the
   search of 4 runs for both, and the faster simulated step wins (ties: the CPU cast, fewer link bytes). The
   closed form ``4n/link`` vs ``2n/link + 2n/cpu_adam_bw`` is only the first guess the bucket size is fitted
   with: it charges the link as if it were on the critical path, which it mostly is not in a CPU-bound step.
0. Parallel degrees (options.dp_degree, options.sp_degree): per-rank costs (token work and activations / sp,
   ZeRO-sharded optimizer state / (dp*sp)); collectives are simulated on the profile's interconnect.
3. Activations per repeated layer (keep / recompute / selective / offload, ``activation_policy.py``): keep what
   fits, offload where the link hides under compute and host memory allows, recompute the rest (all but the
   attention kernels where the device holds their outputs, "selective"); of the mixes cheapest by a per-layer
   estimate, the one with the fastest simulated step.
4. GPU-resident buckets and weight flow, jointly: for each candidate count K of GPU-resident buckets (the last
   K, whose gradients arrive last), make memory fit by streaming the CPU buckets whose transfers hide best
   (``t_compute(reads) / t_transfer`` highest first), give each flow bucket the prefetch distance that hides its
   transfer, then replay the step in the simulator. The fastest feasible K wins (ties: fewer on the GPU).
   ``options.gpu_buckets`` pins K.
5. Rollback mode per CPU bucket: exact (ping-pong state) while host memory allows, else the algebraic inverse
   (``rollback.py``).
"""
from __future__ import annotations

import dataclasses

from ..capture.ir import IR
from ..dtypes import dtype_bytes, gradient_link_name, weights_name
from ..hardware.profiles import HardwareProfile
from ..options import Options
from ..perf.analysis import GraphCosts, analyze, layer_group
from ..perf.cost import CostModel
from ..perf.simulate import simulate
from ..units import human_bytes
from .activation_policy import _activation_policy
from .bucketize import FP32_BYTES, bucketize
from .floor import bucket_size_candidates, bucket_size_line, bucket_text, infeasible_message
from .memory import MemoryEstimate, runtime_device_bytes
from .outputs import outside_loss_note
from .placement import (_apply_flow, _moment_prediction, _parallel_predictions, _plan_of, _prefetch_distances,
                        _speculation, _weight_dtype_prediction, _with_k)
from .transfers import per_step_traffic
from .plan import BucketPlan, Plan
from .host_waits import per_step_job_waits
from .host_work import per_step_host_work
from .rollback import host_layout, rollback_modes
from .search_state import PlanError, _compact_buckets, _Context, _device, _formula  # noqa: F401

FULL_SEARCH = 48          # try every K up to this many buckets; beyond, a grid then a local refinement


def ready_position(ir: IR, params: list[str], position: dict[str, int] | None = None) -> int:
    """Index in backward order after which every gradient of ``params`` exists and no backward node
    reads any of them (or a saved view of them): from there on the weights may be updated in place."""
    if position is None:
        position = {key: i for i, key in enumerate(ir.bw_order)}
    last = max(position[ir.grad_node[p]] for p in params)
    for p in params:
        for reader in ir.bw_readers.get(p, ()):
            last = max(last, position[reader])
    return last


def _layers_text(names) -> str:
    groups = []
    for n in names:
        g = layer_group(n)
        if g not in groups:
            groups.append(g)
    return groups[0] if len(groups) == 1 else f"{groups[-1]}..{groups[0]}" if len(groups) > 2 \
        else f"{groups[1]},{groups[0]}"


@dataclasses.dataclass
class PlanDetails:
    """What the planner computed on the way, for reports and the simulator (not part of the Plan)."""
    plan: Plan
    cost: CostModel
    costs: GraphCosts
    simulation: object        # SimResult of the chosen plan
    zero_offload: object      # SimResult of the ZeRO-Offload schedule on the same buckets


def plan(ir: IR, hw: HardwareProfile, options: Options, shapes: dict[str, int] | None = None,
         activations: tuple | None = None) -> Plan:
    """Plan one compiled graph for ``hw``. ``shapes`` overrides the symbols' values (default: trace shapes).
    ``activations`` pins the per-layer choices ((layer, "keep"|"recompute"|"offload"), ...), e.g. when planning
    again after the recompute pass re-partitioned the graphs: memory and the simulated step then account for
    exactly those choices."""
    return plan_with_details(ir, hw, options, shapes, activations).plan


def plan_with_details(ir: IR, hw: HardwareProfile, options: Options,
                      shapes: dict[str, int] | None = None, activations: tuple | None = None) -> PlanDetails:
    """``plan`` with what the planner computed on the way (the simulations of the chosen plan and of the
    ZeRO-Offload schedule, the cost model): a compile keeps them (CompileContext.plan_details), so reports and
    the simulator read them instead of planning again. Changes nothing outside its own objects."""
    return _plan_with_details(ir, hw, options, shapes, activations)


def _plan_with_details(ir: IR, hw: HardwareProfile, options: Options, shapes, activations) -> PlanDetails:
    dp, sp = options.dp_degree, options.sp_degree
    world = dp * sp
    hw = _per_rank_profile(hw, world)
    cost = CostModel(hw, {**ir.symbol_values, **(shapes or {})})
    costs = analyze(ir, cost, token_shard=sp)
    order = [name for name in ir.grad_order() if ir.params[name].optimized]
    optimized = [ir.params[n] for n in order]
    weight_dtype = weights_name(p.dtype for p in optimized)
    weight_bytes = dtype_bytes(weight_dtype)
    unoptimized = tuple(n for n in ir.grad_order() if not ir.params[n].optimized)
    in_buckets = set(order)
    unopt_numel = sum(p.numel for p in ir.params.values() if p.name not in in_buckets)
    budget = float(options.device_memory_budget if options.device_memory_budget is not None
                   else hw.device_memory - hw.device_reserved)
    template = _Context(ir, hw, options, cost, costs, weight_bytes, budget, unopt_numel, costs.activation_peak,
                        costs.activation_peak_expr, world=world, dp=dp, sp=sp, weight_dtype=weight_dtype,
                        pinned_choices=tuple(activations) if activations is not None else None)
    decisions: list[str] = []
    if world > 1:
        decisions.append(_parallel_line(template))
    ctx, base, recompute = _fitting_buckets(template, order, decisions)
    if not options.speculate:
        decisions.append("objective: the step without speculation (options.speculate=False): every CPU step waits "
                         "for validation after backward")
    elif options.clipping:
        decisions.append("objective: the clipped step (options.clipping, the optimizer's max_grad_norm): every CPU "
                         "step speculated during backward is redone after validation")
    buckets, memory, sim = _placed_buckets(ctx, base, recompute, decisions)
    buckets, host_total, host_pinned, host_parts = rollback_modes(ctx, buckets, decisions)
    zero = simulate(_plan_of(ctx, buckets, recompute, ()), costs, cost, "zero-offload")
    predicted = _plan_predictions(ctx, buckets, memory, sim, zero, (host_total, host_pinned, host_parts))
    times = sim.bucket_times()
    buckets = [dataclasses.replace(b, ready_s=round(times.get(b.index, (sim.backward_end,) * 2)[0], 6),
                                   stepped_s=round(times.get(b.index, (0.0, sim.step_time))[1], 6))
               for b in buckets]
    outputs = outside_loss_note(ir, cost)   # advice, after the decisions it does not change
    if outputs:
        decisions.append(outputs)
    final = _plan_of(ctx, buckets, recompute, predicted, tuple(decisions), unoptimized)
    final = dataclasses.replace(final, predicted=final.predicted + _runtime_predictions(final, ctx))
    from .verify import verify
    verify(final, ir, hw)   # a failure here is a planner bug: never hand an unsafe plan to the passes
    return PlanDetails(final, cost, costs, sim, zero)


def _placed_buckets(ctx: _Context, base, recompute, decisions: list[str]):
    """(buckets, device memory, simulated step) of the cast site and GPU-bucket count chosen, with the user's
    pinned weight modes applied (a pinned placement that does not fit is an error naming the numbers)."""
    options, budget = ctx.options, ctx.budget
    buckets, memory, sim = _choose_cast_and_gpu_buckets(ctx, base, recompute, decisions)
    pinned = _apply_pins(ctx, buckets, decisions)
    if pinned == buckets:
        return buckets, memory, sim
    memory = _device(ctx, pinned)
    sim = simulate(_plan_of(ctx, pinned, recompute, ()), ctx.costs, ctx.cost, speculation=_speculation(options))
    if memory.device_peak > budget:
        raise PlanError(f"the pinned weight placement (weight_mode={options.weight_mode!r}, prefetch_distance="
                        f"{options.prefetch_distance}) needs {human_bytes(memory.device_peak)} of device memory, "
                        f"over the budget of {human_bytes(budget)}; stream more buckets (weight_mode='flow') or "
                        f"leave weight_mode='planned'")
    return pinned, memory, sim


def _plan_predictions(ctx: _Context, buckets, memory, sim, zero, host) -> tuple:
    """The plan's predictions of memory, activations, host memory and the simulated step (``host``: the total,
    pinned bytes and parts of rollback_modes)."""
    host_total, host_pinned, host_parts = host
    costs, cost, names = ctx.costs, ctx.cost, ctx.ir.symbol_names
    counts = {c: sum(1 for _, x in ctx.choices if x == c)
              for c in ("recompute", "selective", "selective_offload", "offload")}
    return (
        ("shapes", tuple(sorted((names.get(k, k), v) for k, v in cost.symbol_values.items()))),
        ("param_dtype_bytes", ctx.weight_bytes),
        *_weight_dtype_prediction(ctx),
        *_moment_prediction(ctx),
        *_parallel_predictions(ctx),
        ("device_budget_bytes", int(ctx.budget)),
        ("device_peak_bytes", int(memory.device_peak)),
        ("device_peak_formula", _formula(memory.device_expr, names)),
        ("device_parts", tuple((k, int(v)) for k, v in memory.device_parts)),
        ("activations_bytes", int(ctx.activations)),
        ("activations_formula", _formula(ctx.activations_expr, names)),
        ("activations_keep_layers", len(costs.layers) - sum(counts.values())),
        ("activations_recompute_layers", counts["recompute"]),
        ("activations_selective_layers", counts["selective"]),
        ("activations_selective_offload_layers", counts["selective_offload"]),
        ("activations_offload_layers", counts["offload"]),
        ("activations_offloaded_bytes", int(ctx.offloaded_bytes)),
        ("host_bytes", int(host_total)),
        ("host_pinned_bytes", int(host_pinned)),
        ("host_parts", tuple((k, int(v)) for k, v in host_parts)),
        ("gpu_buckets", sum(1 for b in buckets if b.optimizer_site == "device")),
        ("flow_buckets", sum(1 for b in buckets if b.weight_mode == "flow")),
        ("model_flops", int(costs.fw_flops + costs.bw_flops)),
        *((k, v) for k, v in sorted(sim.summary().items()) if k != "schedule"),
        ("zero_offload_step_time_s", round(zero.step_time, 6)),
        ("speedup_vs_zero_offload", round(zero.step_time / sim.step_time, 3) if sim.step_time else 0.0),
    )


def _runtime_predictions(final, ctx: _Context) -> tuple:
    """What the runtime does with the final plan, predicted for its ledgers to equal."""
    ir, options, weight_bytes, world = ctx.ir, ctx.options, ctx.weight_bytes, ctx.world
    # What the runtime itself will hold on the device (weights, device optimizer state, flow buffers), walked
    # over the exact flow schedule: tests compare it with the runtime's measured peak byte for byte.
    runtime = runtime_device_bytes(final, ir)
    # What crosses the link per step (one micro-batch), by direction, dtype and purpose: the per-bucket transfer
    # list (plan/transfers.py) the simulator billed; opt.traffic() counts the same at run time.
    traffic = per_step_traffic(final, ir, layers=ctx.costs.layers)
    # What the host CPU reads and writes per step (one micro-batch), by purpose: the terms opt.host_work()
    # books (plan/host_work.py); with clipping, the clipped step's (every speculated CPU step taken again). Under
    # ZeRO, rank 0's: the first ranks hold the fullest windows.
    layout = host_layout(options, weight_bytes)
    host_is_device = options.runtime == "cpu"
    work = per_step_host_work(final, ir, traffic=traffic, shared_master=layout.shared_master,
                              weight_bytes=weight_bytes, validating=bool(options.clipping),
                              speculation=_speculation(options), host_is_device=host_is_device,
                              moment_bytes=layout.moment_bytes, world=world)
    # Where the training thread waits for the CPU jobs in a step (the rule opt.step() applies): what
    # opt.host_blocks() books as "CPU worker job" waits.
    job_waits = per_step_job_waits(final, ir, validating=bool(options.clipping), sharded=world > 1,
                                   shared_master=layout.shared_master, host_is_device=host_is_device)
    return (
        ("link_bytes_per_step", tuple((" ".join(key), int(v)) for key, v in sorted(traffic.items()))),
        ("host_work_bytes_per_step", tuple((purpose, int(r), int(w)) for purpose, (r, w) in sorted(work.items()))),
        ("cpu_job_waits_per_step", tuple(sorted(job_waits.items()))),
        ("runtime_device_peak_bytes", int(runtime["peak"])),
        ("runtime_device_phase_peak_bytes", tuple((k, int(runtime["fixed"] + v))
                                                  for k, v in sorted(runtime["flow_phase_peak"].items()))))


def _per_rank_profile(hw: HardwareProfile, world: int) -> HardwareProfile:
    """The share of a host one rank gets: ranks sharing one host (up to gpus_per_host) split its memory, cores
    and CPU Adam bandwidth (a GH200 rank has a Grace of its own; 8 PCIe GPUs share a server)."""
    share = max(1, min(world, hw.gpus_per_host))
    if share == 1:
        return hw
    return dataclasses.replace(hw, host_memory=hw.host_memory // share, host_cores=max(1, hw.host_cores // share),
                               cpu_adam_bandwidth=hw.adam_bandwidth / share,
                               host_bandwidth=hw.host_bandwidth / share)


def _parallel_line(ctx: _Context) -> str:
    hw = ctx.hw
    nodes = -(-ctx.world // max(1, hw.gpus_per_node))
    sp_bw = hw.group_bandwidth(ctx.sp) if ctx.sp > 1 else 0
    w_bw = hw.group_bandwidth(ctx.world)
    return (f"parallel: dp {ctx.dp} x Ulysses sp {ctx.sp} = {ctx.world} ranks on {nodes} node(s) of "
            f"{hw.gpus_per_node} GPU(s); per rank: seq/{ctx.sp} tokens' activations, 1/{ctx.world} of optimizer "
            f"state (ZeRO); all-to-all at {sp_bw / 1e9:.0f} GB/s, reduce-scatter/all-gather at "
            f"{w_bw / 1e9:.0f} GB/s per GPU per direction (x{_net_eff():.2f} achieved)")


def _net_eff() -> float:
    from ..perf.cost import NET_EFFICIENCY
    return NET_EFFICIENCY


def _fitting_buckets(template: _Context, order: list[str], decisions: list[str]):
    """(ctx, base buckets, Plan.recompute) for the first bucket size whose floor (_min_device) fits the budget.
    Each candidate plans its activations afresh (the floor of the rest of the plan depends on the buckets), on
    a copy of ``template`` whose options carry that size. Raises PlanError with the lowest floor found."""
    floors = []
    sizes = bucket_size_candidates(template, order)
    for size in sizes:
        ctx = dataclasses.replace(template, options=dataclasses.replace(template.options, bucket_size=size))
        lines: list[str] = []
        base = _base_buckets(ctx.ir, order, size, ctx, lines)
        ctx, recompute = _activation_policy(ctx, base, lines)
        minimum = _min_device(ctx, base)
        if minimum.device_peak <= ctx.budget:
            if floors:   # the default did not fit (no line otherwise: the presets' plans stay byte-identical)
                lines.insert(0, bucket_size_line(ctx, size, *floors[-1][:2]))
            decisions.extend(lines)
            return ctx, base, recompute
        floors.append((minimum.device_peak, size, ctx, minimum, recompute, base))
    _, size, ctx, minimum, recompute, base = min(floors, key=lambda f: (f[0], -f[1]))
    raise PlanError(infeasible_message(ctx, minimum, recompute, bucket_text(ctx, base, chosen=len(sizes) > 1),
                                     base))


def _base_buckets(ir: IR, order: list[str], bucket_size: int, ctx: _Context, decisions: list[str]):
    groups = bucketize([(n, ir.params[n].numel) for n in order], bucket_size)
    hw, wb = ctx.hw, ctx.weight_bytes
    grad_dtype = gradient_link_name(ctx.weight_dtype)
    if wb == 4:
        cast_site, param_dtype = "device", "float32"
        reason = "weights train in float32: no cast; gradients and weights cross as float32"
    else:
        t_device = 4 / hw.h2d_bandwidth
        t_cpu = 2 / hw.h2d_bandwidth + 2 / hw.adam_bandwidth
        if t_device <= t_cpu:
            cast_site, param_dtype = "device", "float32"
        else:
            cast_site, param_dtype = "cpu", ctx.weight_dtype
        reason = (f"fp32 over the link {t_device * 1e12:.1f} ps/param vs bf16 + CPU cast "
                  f"{t_cpu * 1e12:.1f} ps/param (link {hw.h2d_bandwidth / 1e9:.0f} GB/s, CPU Adam "
                  f"{hw.adam_bandwidth / 1e9:.0f} GB/s): cast on the {'GPU' if cast_site == 'device' else 'CPU'}; "
                  + ("gradients cross as bf16, read directly by the CPU kernel" if grad_dtype == "bfloat16" else
                     "fp16 gradients cross as fp32, cast on the GPU (exact; the CPU kernel reads fp32 or bf16)"))
    decisions.append(f"casts: {reason}")
    buckets = []
    position = {key: i for i, key in enumerate(ir.bw_order)}
    for index, names in enumerate(groups):
        pos = ready_position(ir, names, position)
        numel = sum(ir.params[n].numel for n in names)
        buckets.append(BucketPlan(index=index, params=tuple(names), numel=numel, grad_bytes=numel * FP32_BYTES,
                                  optimizer_site="cpu", ready_after=ir.bw_order[pos], ready_position=pos,
                                  cast_site=cast_site, link_dtype=grad_dtype, param_link_dtype=param_dtype,
                                  cast_reason=reason, layers=_layers_text(names)))
    return buckets


def _cast_to(ctx: _Context, base, site: str, reason: str) -> list:
    """``base`` with the updated weights of its (stationary) buckets cast on ``site``: "device" (fp32 crosses)
    or "cpu" (the kernel writes the model's 2-byte dtype in its pass, and that crosses)."""
    param_dtype = "float32" if site == "device" else ctx.weight_dtype
    return [dataclasses.replace(b, cast_site=site, param_link_dtype=param_dtype, cast_reason=reason) for b in base]


def _choose_cast_and_gpu_buckets(ctx: _Context, base, recompute: str, decisions: list[str]):
    """The cast site and the GPU-resident bucket count, jointly, by the simulated step: for 2-byte weights the
    search of GPU buckets runs once per cast site and the faster step wins (ties: the CPU cast, which moves
    half the weight bytes over the link). fp32 weights have nothing to cast; options.cast_site pins the site
    the search runs with (its decision line comes with the other pins, _apply_pins)."""
    if ctx.weight_bytes == 4:
        return _choose_gpu_buckets(ctx, base, recompute, decisions)
    pinned = ctx.options.cast_site
    if pinned is not None:
        return _choose_gpu_buckets(ctx, _cast_to(ctx, base, pinned, base[0].cast_reason if base else ""), recompute,
                                   decisions)
    tried = {}
    for site in ("cpu", "device"):
        lines: list[str] = []
        tried[site] = (_choose_gpu_buckets(ctx, _cast_to(ctx, base, site, ""), recompute, lines), lines)
    site = min(tried, key=lambda s: tried[s][0][2].step_time)   # min keeps the first ("cpu") on a tie
    other = "device" if site == "cpu" else "cpu"
    (buckets, memory, sim), lines = tried[site]
    crossing = {"cpu": f"the CPU kernel writes {ctx.weight_dtype} weights in its pass and they cross as "
                       f"{ctx.weight_dtype}", "device": "fp32 weights cross and are cast on the GPU"}
    mine, theirs = sim.step_time, tried[other][0][2].step_time
    where = {"cpu": "CPU", "device": "GPU"}
    if not any(b.optimizer_site == "cpu" and b.weight_mode == "stationary" for b in buckets):
        verdict = "no CPU-stepped bucket uploads stationary weights: the one with half the link bytes"
    elif mine < theirs:
        verdict = (f"simulated step {mine * 1e3:.3f} ms vs {theirs * 1e3:.3f} ms cast on the {where[other]} "
                   f"({crossing[other]})")
    else:
        verdict = (f"the same simulated step either way ({mine * 1e3:.3f} ms: neither the CPU pass nor the uploads "
                   f"are on its critical path), so the one with half the link bytes")
    reason = (f"cast on the {where[site]} ({crossing[site]}): {verdict}; "
              + ("gradients cross as bf16, read directly by the CPU kernel" if ctx.weight_dtype == "bfloat16" else
                 "fp16 gradients cross as fp32, cast on the GPU (exact; the CPU kernel reads fp32 or bf16)"))
    first_guess = next(i for i, line in enumerate(decisions) if line.startswith("casts: "))
    decisions[first_guess] = f"casts: {reason}"
    decisions.extend(lines)
    buckets = [dataclasses.replace(b, cast_reason=reason) if b.cast_site == site and b.cast_reason == "" else b
               for b in buckets]
    return buckets, memory, sim


def _min_device(ctx: _Context, base) -> MemoryEstimate:
    """The least device memory a plan over ``base`` can take: every bucket on the CPU, every bucket that can
    stream (_compact_buckets) streamed at prefetch distance 0 (one flow buffer live at a time: the transfer is
    not hidden). _with_k falls back to exactly this placement, so a budget of this size plans."""
    return _device(ctx, _apply_flow(ctx, base, _compact_buckets(ctx, base), {}, distance=0))


def _choose_gpu_buckets(ctx: _Context, base, recompute: str, decisions: list[str]):
    n = len(base)
    cache: dict = {}
    results: dict[int, tuple] = {}

    def evaluate(k: int):
        if k in results:
            return results[k]
        made = _with_k(ctx, base, k, cache)
        if made is None:
            results[k] = None
            return None
        buckets, memory = made
        sim = simulate(_plan_of(ctx, buckets, recompute, ()), ctx.costs, ctx.cost,
                       speculation=_speculation(ctx.options))
        results[k] = (buckets, memory, sim)
        return results[k]

    pinned = ctx.options.gpu_buckets
    if pinned is not None:
        if not 0 <= pinned <= n:
            raise PlanError(f"gpu_buckets={pinned} but the model has {n} bucket(s); choose 0..{n} or None")
        got = evaluate(pinned)
        if got is None:
            raise PlanError(f"gpu_buckets={pinned} does not fit in {human_bytes(ctx.budget)} of device memory "
                            f"even with weight flow; use fewer GPU buckets or leave gpu_buckets=None")
        decisions.append(f"GPU-resident buckets: {pinned} of {n} (pinned by options.gpu_buckets)")
        return got
    # Largest feasible K (memory grows with K), by bisection.
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _with_k(ctx, base, mid, cache) is not None:
            lo = mid
        else:
            hi = mid - 1
    k_max = lo
    if k_max + 1 <= FULL_SEARCH:
        candidates = list(range(k_max + 1))
    else:
        step = max(1, k_max // FULL_SEARCH)
        candidates = sorted({*range(0, k_max + 1, step), k_max})
    for k in candidates:
        evaluate(k)
    if all(v is None for v in results.values()):
        raise PlanError(f"no placement of the {n} bucket(s) fits {human_bytes(ctx.budget)} of device memory beside "
                        f"{human_bytes(ctx.activations)} of activations (buckets whose weights are read in two places, "
                        f"e.g. tied embeddings, cannot stream); lower the sequence length or batch, or set "
                        f"activations='recompute'")
    best_k = min((k for k in results if results[k] is not None), key=lambda k: (results[k][2].step_time, k))
    if k_max + 1 > FULL_SEARCH:   # refine around the best grid point
        step = max(1, k_max // FULL_SEARCH)
        for k in range(max(0, best_k - step), min(k_max, best_k + step) + 1):
            evaluate(k)
        best_k = min((k for k in results if results[k] is not None), key=lambda k: (results[k][2].step_time, k))
    sim = results[best_k][2]
    decisions.append(f"GPU-resident buckets: {best_k} of {n} (chosen: fastest simulated step {sim.step_time:.4f} s "
                     f"among {len(results)} candidates, up to {k_max} fit in memory)")
    flows = sum(1 for b in results[best_k][0] if b.weight_mode == "flow")
    if flows:
        decisions.append(f"weight flow: {flows} bucket(s) streamed from host memory to fit "
                         f"{human_bytes(ctx.budget)} (compute-heavy buckets first, so transfers hide)")
    return results[best_k]


def _apply_pins(ctx: _Context, buckets, decisions: list[str]):
    """Options that pin per-bucket decisions (tests and experiments force plan shapes through these)."""
    opts = ctx.options
    mode = opts.weight_mode
    out = list(buckets)
    if mode != "planned":
        if mode.startswith("flow:"):
            wanted = {int(i) for i in mode[len("flow:"):].split(",")}
            bad = sorted(i for i in wanted if i >= len(out) or out[i].optimizer_site == "device")
            if bad:
                raise PlanError(f"weight_mode={mode!r} names bucket(s) {bad}, which do not exist or are stepped on "
                                f"the device (their master weights live there, nothing to stream); the plan has "
                                f"{len(out)} bucket(s), {sum(b.optimizer_site == 'device' for b in out)} on the device")
        else:
            wanted = {b.index for b in out if b.optimizer_site == "cpu"} if mode == "flow" else set()
        stationary = [dataclasses.replace(b, weight_mode="stationary", prefetch_distance=0) for b in out]
        out = _apply_flow(ctx, stationary, wanted, _prefetch_distances(ctx, out, wanted)) if wanted else stationary
        decisions.append(f"weight placement pinned by options.weight_mode={mode!r}: "
                         f"{len(wanted)} of {len(out)} bucket(s) flow")
    if opts.prefetch_distance is not None:
        out = [dataclasses.replace(b, prefetch_distance=opts.prefetch_distance) if b.weight_mode == "flow" else b
               for b in out]
        decisions.append(f"prefetch distance pinned to {opts.prefetch_distance} by options.prefetch_distance")
    if opts.cast_site is not None:
        link = ctx.weight_dtype if opts.cast_site == "cpu" and ctx.weight_bytes == 2 else \
            "bfloat16" if opts.cast_site == "cpu" else "float32"
        out = [dataclasses.replace(b, cast_site=opts.cast_site, param_link_dtype=link,
                                   cast_reason=f"pinned by options.cast_site={opts.cast_site!r}")
               if b.optimizer_site == "cpu" else b for b in out]
        decisions.append(f"casts pinned to the {opts.cast_site} by options.cast_site: weights cross as {link}")
    if opts.grad_link_dtype is not None:
        out = [dataclasses.replace(b, link_dtype=opts.grad_link_dtype) if b.optimizer_site == "cpu" else b
               for b in out]
        decisions.append(f"gradients cross the link as {opts.grad_link_dtype} (options.grad_link_dtype)")
    return out
