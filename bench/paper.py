"""The SuperOffload paper's GH200 claims against our planner + simulator, on our own profiles.

    python bench/paper.py
Prints: claim, paper, ours, ratio, basis, note. Each row traces a model under FakeTensorMode (no weights in
memory). The basis column says what a row's figure rests on (LABELS); the measured row reads what
bench/gpu_buckets_cpu.py --record wrote.
"""
from __future__ import annotations

import json
import pathlib

import torch

from socompile.offline import plan_model
from socompile.options import Options
from socompile.hardware import get_profile
from socompile.plan.planner import PlanError, plan_with_details
from socompile.hardware.cpu_adam import MEASURED as MEASURED_ADAM
from socompile.perf.cost import EFFICIENCY
from socompile.perf.simulate import recompute_time

GPU_BUCKETS_CPU = pathlib.Path(__file__).resolve().parent / "results" / "gpu_buckets_cpu.json"
DEEPSPEED_RATIO = 0.9   # SuperOffload's `ratio` in DeepSpeed's published configs (share of sub-groups on the CPU)
LABELS = {
    "measured": "measured on this machine (the bench named in the note)",
    "measured-input": "simulated; the figure follows from an input measured here (bench/adam.py's CPU Adam rates)",
    "simulated": "planner + simulator on the datasheet profile (CPU Adam at the measured share, as everywhere)",
    "restated": "restates an assumed input of the cost model: it cannot disagree with it",
}


def details(model: str, seq: int, batch: int, target: str = "gh200", **opts):
    from socompile.models import build
    from socompile.models.llama import PRESETS
    factory = (lambda: build(model, max_seq_len=seq)) if seq > PRESETS[model].max_seq_len else model
    ctx = plan_model(factory, batch=batch, seq=seq, options={"target": target, **opts}, dtype=torch.bfloat16,
                     run_passes=False)
    return ctx, ctx.plan_details   # the planning plan_model did


def _layer_mix(p) -> str:
    """Per-layer activation choices of a plan, e.g. 'keep/offload/selective(+offload)/recompute 29/11/0(+0)/0'."""
    n = {c: p.prediction(f"activations_{c}_layers") for c in ("keep", "offload", "selective", "selective_offload",
                                                              "recompute")}
    return (f"keep/offload/selective(+offload)/recompute {n['keep']}/{n['offload']}/{n['selective']}"
            f"(+{n['selective_offload']})/{n['recompute']}")


def million_token_row():
    """13B at 1M tokens on 8 GH200 (ZeRO-DP x Ulysses sp=8, weight flow, activations offloaded/recomputed).
    The whole 1M-token sequence is traced under FakeTensorMode (shapes only); the planner divides token work
    and activations by sp. Returns (details, MFU in model FLOPs: causal attention counted as the kernel runs it)."""
    _, d = details("llama-13b", 1 << 20, 1, sp_degree=8)
    return d, d.simulation.mfu


def main() -> None:
    rows = []
    # 1. Up to 2.5x throughput over ZeRO-Offload (paper, GH200). Throughput runs used seq 1024 (artifact configs).
    for label, acts in (("", "auto"), ("  same, activation checkpointing on both (artifact configs)", "recompute")):
        best = (0.0, "", "")
        for model in ("llama-7b", "llama-13b"):
            _, d = details(model, 1024, 8, activations=acts)
            z = d.zero_offload
            speedup = z.step_time / d.simulation.step_time
            best = max(best, (speedup, model, f"{model}: {d.simulation.step_time:.3f} s vs {z.step_time:.3f} s, "
                                              f"ZeRO CPU tail {z.exposed_tail:.3f} s after backward; its CPU Adam "
                                              f"at {MEASURED_ADAM.baseline_of_ours:.2f} of ours (bench/adam.py)"))
        rows.append((label or "speedup over ZeRO-Offload (max of 7B/13B, seq 1024 b8)", 2.5, best[0], best[2],
                     "measured-input"))
    # 2. 25B parameters trainable on one GH200 (30 layers x hidden 8192), and 28B past the paper (34 layers).
    # Fits: device memory, and host memory as the runtime allocates it (plan/memory.py host_buffers, equal to
    # the runtime's HostLedger byte for byte on small shapes, tests/test_host_memory.py) within 90% of 480 GB.
    for label, model, claim in (("largest model trained on one GH200 (B params)", "llama-25b", 25.0),
                                ("  same, past the paper: 28B on one GH200 (B params)", "llama-28b", 28.0)):
        try:
            ctx, d = details(model, 1024, 4)
            params = sum(b.numel for b in d.plan.buckets) / 1e9
            host, pinned = d.plan.prediction("host_bytes"), d.plan.prediction("host_pinned_bytes")
            inverse = sum(b.rollback == "inverse" for b in d.plan.buckets)
            note = (f"fits: device {d.plan.prediction('device_peak_bytes') / 1e9:.0f} GB, host {host / 1e9:.0f} GB "
                    f"({pinned / 1e9:.0f} pinned), {inverse} inverse-rollback buckets")
        except PlanError as err:
            params, note = 0.0, f"does not fit: {err}"[:80]
        rows.append((label, claim, params, note))
    # 3. ~600 TFLOP/s on a Qwen3-14B-class model at seq 4096, batch 4 (blog). Our 13B preset is the closest.
    _, d = details("llama-13b", 4096, 4)
    # Recomputed layers run their forward again (selective ones all but attention): that share of the forward
    # FLOPs (by time) is counted twice.
    redo = sum(recompute_time(lc, d.plan.activation_choice(lc.name)) for lc in d.costs.layers)
    hardware_flops = d.simulation.model_flops + d.costs.fw_flops * (redo / d.costs.fw_time if d.costs.fw_time else 0)
    rows.append(("TFLOP/s, 13B seq 4096 b4 (model FLOPs)", 600.0, d.simulation.tflops,
                 f"MFU {d.simulation.mfu * 100:.0f}%; layers {_layer_mix(d.plan)}", "simulated"))
    rows.append(("TFLOP/s, 13B seq 4096 b4 (incl. recompute)", 600.0,
                 hardware_flops / d.simulation.step_time / 1e12, "counts re-run forward like a profiler would",
                 "simulated"))
    # 4. 13B at 1M tokens on 8 GH200 at 55% MFU (ZeRO-DP + Ulysses sp=8, weight flow, offloaded checkpoints).
    d, mfu = million_token_row()
    p = d.plan
    rows.append(("MFU %, 13B at 1M tokens on 8 GH200 (Ulysses sp=8)", 55.0, mfu * 100,
                 f"step {d.simulation.step_time:.0f} s; layers {_layer_mix(p)}; all-to-all "
                 f"{p.prediction('comm_ulysses_bytes', 0) / 1e9:.0f} GB/rank, {p.prediction('comm_busy_s', 0):.1f} s",
                 "simulated"))
    redo = sum(recompute_time(lc, p.activation_choice(lc.name)) for lc in d.costs.layers)
    executed = d.simulation.model_flops + d.costs.fw_flops * (redo / d.costs.fw_time if d.costs.fw_time else 0)
    rows.append(("  same, counting the recomputed forward FLOPs (hardware FLOPs)", 55.0,
                 executed / d.simulation.step_time / d.simulation.peak_flops * 100,
                 "what a profiler counts; the paper does not say which it reports", "simulated"))
    bound = _attention_bound(d)
    rows.append(("  same, upper bound: no recompute, no communication", 55.0, bound * 100,
                 f"restates the cost model's attention efficiency ({EFFICIENCY['attention']:.2f} of peak), which "
                 f"sets the compute-only MFU at 1M tokens", "restated"))
    rows += deepspeed_ratio_rows()
    rows.append(gpu_buckets_cpu_row())
    print(f"{'claim':<66}{'paper':>8}{'ours':>9}{'ratio':>7}  {'basis':<15}note")
    for claim, paper, ours, note, *label in rows:
        basis = label[0] if label else "simulated"   # a row without a label rests on the simulator alone
        if ours is None:
            print(f"{claim:<66}{paper:>8.1f}{'-':>9}{'-':>7}  {basis:<15}{note}")
        else:
            print(f"{claim:<66}{paper:>8.1f}{ours:>9.2f}{ours / paper:>7.2f}  {basis:<15}{note}")
    print("\nbasis: " + "\n       ".join(f"{k}: {v}" for k, v in LABELS.items()))
    print(f"CPU Adam rates: {MEASURED_ADAM.describe()}")
    print(NOTES)


def deepspeed_ratio_rows():
    """The planner's GPU-bucket count against DeepSpeed's recommended `ratio` 0.9 (sub-group i stays on the GPU
    iff i < int((1 - ratio) * N)), on the same work (7B, seq 4096, b4): as a time ratio (> 1: auto is faster).
    Each arm is planned for the step it runs: unclipped, and clipped (options.clipping, as a compile with
    socompile.AdamW(max_grad_norm=...) plans it: every speculated CPU step is redone after validation, and the
    planner optimises that step). Auto wins by construction whenever that K is among the planner's candidates
    (it searches the same simulator; beyond 48 buckets on a grid, then around the grid's best), so the rows say
    by how much; a ratio below 1 means its K grid skipped the best K."""
    ctx, d = details("llama-7b", 4096, 4)
    n = len(d.plan.buckets)
    k_ds = int((1 - DEEPSPEED_RATIO) * n)
    hw = get_profile("gh200")
    ds = plan_with_details(ctx.ir, hw, Options(gpu_buckets=k_ds))
    rows = [("auto GPU buckets vs DeepSpeed ratio 0.9 (7B s4096 b4; time ratio)", 1.0,
             ds.simulation.step_time / d.simulation.step_time,
             f"auto K={d.plan.prediction('gpu_buckets')} {d.simulation.step_time:.3f} s; ratio 0.9 K={k_ds} of {n} "
             f"{ds.simulation.step_time:.3f} s (unclipped)", "simulated")]
    clipped, ds_clipped = (plan_with_details(ctx.ir, hw, Options(clipping=True, **pin)) for pin in
                           ({}, {"gpu_buckets": k_ds}))
    rows.append(("  same, clipped step (every speculated CPU step redone)", 1.0,
                 ds_clipped.simulation.step_time / clipped.simulation.step_time,
                 f"auto K={clipped.plan.prediction('gpu_buckets')} {clipped.simulation.step_time:.3f} s; ratio 0.9 "
                 f"K={k_ds} {ds_clipped.simulation.step_time:.3f} s; both planned for the clipped step", "simulated"))
    return rows


def gpu_buckets_cpu_row():
    """On this CPU: the best measured GPU-bucket count's median step time over the planner's (1: the planner
    found the best; below 1: it lost), worst preset of bench/gpu_buckets_cpu.py's recorded run."""
    claim = "planner's GPU buckets vs best measured count, this CPU (time ratio)"
    if not GPU_BUCKETS_CPU.exists():
        return (claim, 1.0, None, f"not measured: run python bench/gpu_buckets_cpu.py --record "
                                  f"{GPU_BUCKETS_CPU.relative_to(GPU_BUCKETS_CPU.parents[2])}", "measured")
    data = json.loads(GPU_BUCKETS_CPU.read_text())
    parts, worst = [], None
    for preset, r in data["presets"].items():
        best_over_planner = 1 / r["planner_over_best"]
        worst = best_over_planner if worst is None else min(worst, best_over_planner)
        ours, best = r["per_k"][str(r["planner_k"])], r["per_k"][str(r["best_k"])]
        noise = " (inside the best's spread)" if best["min_s"] <= ours["median_s"] <= best["max_s"] else ""
        parts.append(f"{preset}: K={r['planner_k']} of {r['buckets']} {ours['median_s'] * 1e3:.0f} ms, best K="
                     f"{r['best_k']} {best['median_s'] * 1e3:.0f} ms ({best['min_s'] * 1e3:.0f}-"
                     f"{best['max_s'] * 1e3:.0f}){noise if r['planner_k'] != r['best_k'] else ''}")
    missing = f"; {data['note']}" if data.get("note") else ""
    return (claim, 1.0, worst, "; ".join(parts) + f" (bench/gpu_buckets_cpu.py, {data['measured_at']}, {data['machine']})"
            + missing, "measured")


def _attention_bound(d) -> float:
    """MFU of the compute alone (fw + bw node times, no recompute, no waits): the cost model's ceiling."""
    return d.simulation.model_flops / (d.costs.fw_time + d.costs.bw_time) / d.simulation.peak_flops


NOTES = """
What remains different (docs/planner.md, "Simulator vs the paper", has the numbers):
- ZeRO-Offload speedup: our baseline runs DeepSpeed's step after backward (unscale/clip pass over the fp32
  gradients, CPU Adam at DeepSpeedCPUAdam's share of ours as bench/adam.py measured it, CPU cast of the updated
  weights, upload), each pass on all cores one after the other; gradients are cast on the GPU and copied
  during backward, as DeepSpeed does. Our SuperOffload
  side has no measured overheads (validation, launch gaps, Python), which the paper's runs pay. The paper's
  throughput configs checkpoint activations, which adds GPU time to both sides and lowers the ratio.
- GPU buckets: against DeepSpeed's ratio 0.9, each arm planned for the step it runs: unclipped, and clipped
  (every speculated CPU step redone after backward; the planner optimises that step when the optimizer clips,
  and then keeps more buckets on the GPU). On this CPU the planner's count is checked against every count
  measured (bench/gpu_buckets_cpu.py).
- TFLOP/s at seq 4096: our 13B is Llama-2-13B-shaped, the blog's model Qwen3-14B; attention FLOPs are counted
  causal (what FlashAttention runs); the plan offloads some layers' activations to fit 94 GB.
- 1M tokens: offloading whole layers does not fit beside the layer inputs; 'selective' (keep the attention
  outputs, recompute the rest: 0.27 instead of 2.86 s per layer) fits on the device for 19 layers, the other 21
  keep their checkpoints (output, attention outputs) in host memory ('selective_offload', like the paper's
  offloaded checkpoints). What remains: the re-run projections/MLP and the all-to-alls on the critical path.
"""


if __name__ == "__main__":
    main()
