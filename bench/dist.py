"""Communication and step time of socompile's distributed training, per step and per rank, against the
analytic minimum and against an anchor, in one run.

    python bench/dist.py              # 2 gloo ranks on this CPU, tiny preset, a few steps

Arms (the same ranks, the same process group, one after the other):
- ours: socompile.AdamW sharded with ``shard_optimizer`` (ZeRO-2 style: reduce-scatter of the gradients,
  each rank steps its shard, all-gather of the weights), clipping on;
- anchor: torch DDP (one all-reduce of the gradients per bucket) + torch.optim.AdamW + clip_grad_norm_.

Bytes: what each arm hands to its collectives, as a bandwidth-optimal (ring) algorithm sends it per rank,
against ``socompile.distributed.volumes.zero_min_bytes`` for the dtype the link actually carried (measured:
bytes handed / elements handed). That one function is the minimum of every arm and of tests/test_dist_bench.py:
2 (W-1)/W x params x bytes per element (an all-reduce moves as much as a reduce-scatter plus an all-gather).
Ours pads each bucket to a multiple of W and adds one 16-byte all-reduce for validation: the ratio must stay
<= 1.05. Step times: the slowest rank's, per step after one warm-up step; printed as median and spread
(min .. max) for each arm.

Also prints the 8 x GH200, 13B, 1M-token configuration of the paper (55% MFU), planned and simulated for one
rank (socompile/perf/simulate.py: Ulysses all-to-alls around every attention, ZeRO reduce-scatter/all-gather per
bucket, on the profile's interconnect), beside the analytic volumes. ``--no-sim`` skips it (it traces 4 of
13B's blocks at 1M tokens under FakeTensorMode and plans: ~10 s).
"""
from __future__ import annotations

import pathlib
import statistics
import sys
import time

import torch

from socompile.distributed.volumes import ulysses_bytes_per_layer, zero_min_bytes

HERE = str(pathlib.Path(__file__).resolve())
DTYPE_OF_SIZE = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def _timed_steps(step, steps: int, group) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step`` after one warm-up, the slowest rank's (a step ends when the
    last rank's does); the max is all-reduced outside the timed region."""
    import torch.distributed as dist

    step()
    times = []
    for _ in range(steps):
        dist.barrier(group)
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        times.append(float(elapsed))
    return times


def _batches(rank: int):
    gen = torch.Generator().manual_seed(rank)
    while True:
        yield torch.randint(0, 256, (2, 64), generator=gen)


def _ours(args: dict, topo) -> dict:
    import torch.nn.functional as F

    import socompile
    import socompile.distributed as sd
    from socompile.models import build

    torch.manual_seed(0)
    model = build(args["preset"], **args.get("model", {}))
    opt = socompile.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0, bucket_size=args["bucket"])
    sharding = sd.shard_optimizer(opt, topo.world_group)
    data = _batches(topo.rank)

    def step():
        x = next(data)
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()

    times = _timed_steps(step, args["steps"], topo.world_group)
    stats = sharding.stats.as_dict()
    world = topo.world_size
    handed = stats["steps"] * sum(-(-b.numel // world) * world for b in opt.buckets)   # padded elements per call
    return {"times": times, "steps": stats["steps"], "sent": stats["sent_bytes"],
            "rs": stats["reduce_scatter_bytes"], "ag": stats["all_gather_bytes"],
            "grad_size": stats["reduce_scatter_bytes"] / handed, "weight_size": stats["all_gather_bytes"] / handed,
            "params": sum(p.numel() for p in model.parameters()), "buckets": len(opt.buckets)}


def _anchor(args: dict, topo) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from socompile.models import build

    torch.manual_seed(0)
    model = build(args["preset"], **args.get("model", {}))
    ddp = DistributedDataParallel(model, process_group=topo.world_group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handed = {"bytes": 0, "elements": 0, "calls": 0}

    def counting_allreduce(group, bucket):
        buffer = bucket.buffer()
        handed["bytes"] += buffer.numel() * buffer.element_size()
        handed["elements"] += buffer.numel()
        return allreduce_hook(group, bucket)

    ddp.register_comm_hook(topo.world_group, counting_allreduce)
    data = _batches(topo.rank)

    def step():
        x = next(data)
        F.cross_entropy(ddp(x).flatten(0, 1), x.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        handed["calls"] += 1

    times = _timed_steps(step, args["steps"], topo.world_group)
    world = dist.get_world_size(topo.world_group)
    # a ring all-reduce sends 2 (W-1)/W of the buffer per rank: a reduce-scatter, then an all-gather
    return {"times": times, "steps": handed["calls"], "sent": 2 * (world - 1) / world * handed["bytes"],
            "grad_size": handed["bytes"] / handed["elements"], "weight_size": handed["bytes"] / handed["elements"],
            "params": sum(p.numel() for p in model.parameters())}


def _worker(args: dict) -> dict:
    import socompile.distributed as sd

    topo = sd.init_distributed(dp=args["world"], timeout_s=120)
    result = {"ours": _ours(args, topo), "anchor": _anchor(args, topo)}
    sd.shutdown()
    return result


def carried_dtype(element_size: float) -> torch.dtype:
    """The dtype of what a link carried, from bytes handed per element handed (2: bf16, 4: fp32)."""
    if element_size not in DTYPE_OF_SIZE:
        raise RuntimeError(f"{element_size} bytes per element handed to the collectives: not one dtype's size")
    return DTYPE_OF_SIZE[int(element_size)]


def _row(arm: dict, world: int) -> dict:
    grad, weight = carried_dtype(arm["grad_size"]), carried_dtype(arm["weight_size"])
    minimum = zero_min_bytes(arm["params"], world, grad, weight)
    per_step = arm["sent"] / arm["steps"]
    return {**arm, "grad_dtype": grad, "weight_dtype": weight, "per_step": per_step, "minimum": minimum,
            "ratio": per_step / minimum, "median_s": statistics.median(arm["times"]),
            "min_s": min(arm["times"]), "max_s": max(arm["times"])}


def measure(preset: str = "tiny", world: int = 2, steps: int = 5, bucket: str = "256KB",
            model: dict | None = None) -> dict:
    """Both arms on ``world`` gloo ranks of this machine: {"ours": row, "anchor": row} (rank 0's view)."""
    from socompile.distributed.launch import run_local

    results = run_local(f"{HERE}:_worker", world, {"preset": preset, "world": world, "steps": steps,
                                                   "bucket": bucket, "model": model or {}}, timeout_s=300)
    for r in results:
        if r.returncode != 0:
            raise SystemExit(f"rank {r.rank} failed:\n{r.output[-3000:]}")
    s = results[0].result
    rows = {arm: _row(s[arm], world) for arm in ("ours", "anchor")}
    for row in rows.values():
        row.update(preset=preset, world=world)
    rows["ours"]["rs"] /= rows["ours"]["steps"]
    rows["ours"]["ag"] /= rows["ours"]["steps"]
    return rows


def simulated_row(world: int = 8, seq: int = 1 << 20, preset: str = "llama-13b") -> dict:
    """``preset`` at ``seq`` tokens, Ulysses sp=world, ZeRO over the world: one rank planned and simulated on
    gh200 (bf16 on the links)."""
    from socompile.models import build
    from socompile.offline import plan_model
    ctx = plan_model(lambda: build(preset, max_seq_len=seq), batch=1, seq=seq,
                     options={"target": "gh200", "sp_degree": world}, dtype=torch.bfloat16, run_passes=False)
    d = ctx.plan_details   # the planning plan_model did
    p, sim = d.plan, d.simulation
    return {"ulysses": p.prediction("comm_ulysses_bytes"), "zero": p.prediction("comm_zero_bytes"),
            "busy_s": p.prediction("comm_busy_s"), "exposed_s": p.prediction("comm_exposed_s"),
            "step_s": sim.step_time, "forward_s": sim.forward_end, "tflops": sim.tflops, "mfu": sim.mfu,
            "keep": p.prediction("activations_keep_layers"), "offload": p.prediction("activations_offload_layers"),
            "recompute": p.prediction("activations_recompute_layers"),
            "selective": p.prediction("activations_selective_layers")
            + p.prediction("activations_selective_offload_layers"),
            "device_peak": p.prediction("device_peak_bytes"), "host": p.prediction("host_bytes"),
            "params": sum(b.numel for b in p.buckets)}


def paper_rows(simulate: bool = True) -> list[str]:
    from socompile.models.llama import PRESETS

    cfg = PRESETS["llama-13b"]
    world, seq = 8, 1 << 20
    params = cfg.num_params()
    zero = zero_min_bytes(params, world, torch.bfloat16)   # bf16 gradients and weights on the GPUs' links
    kv = cfg.dim // cfg.n_heads * cfg.n_kv_heads
    # Ulysses, per layer: forward and backward move the same all-to-alls
    per_layer = 2 * ulysses_bytes_per_layer(cfg.dim, kv, seq, world, torch.bfloat16)
    ulysses = per_layer * cfg.n_layers
    lines = [f"8x GH200, llama-13b ({params / 1e9:.1f}B), seq 1M, batch 1, ZeRO over 8 ranks x Ulysses sp=8; "
             f"paper: 55% MFU",
             f"  analytic volume per step per rank (bf16): ZeRO reduce-scatter+all-gather {zero / 1e9:.1f} GB, "
             f"Ulysses all-to-all {ulysses / 1e9:.1f} GB ({per_layer / 1e9:.2f} GB per layer, fwd+bwd; "
             f"recomputed and selective layers send their forward share again)"]
    if not simulate:
        return lines
    r = simulated_row()
    lines += [
        "  simulated per rank (gh200: one Superchip per node, NDR 400 Gb/s = 50 GB/s per direction, x0.8 achieved):",
        f"    sent: Ulysses all-to-all {r['ulysses'] / 1e9:.1f} GB, ZeRO {r['zero'] / 1e9:.1f} GB; network busy "
        f"{r['busy_s']:.1f} s, {r['exposed_s']:.1f} s of it with the GPU idle",
        f"    step {r['step_s']:.1f} s (forward {r['forward_s']:.1f} s), {r['tflops']:.0f} TFLOP/s, "
        f"MFU {r['mfu'] * 100:.1f}% (paper 55%); layers keep/offload/selective/recompute {r['keep']}/"
        f"{r['offload']}/{r['selective']}/{r['recompute']}; device peak {r['device_peak'] / 1e9:.1f} GB, host {r['host'] / 1e9:.0f} GB per rank",
    ]
    return lines


def main(argv: list[str]) -> int:
    rows = measure()
    ours = rows["ours"]
    print(f"{ours['world']} gloo ranks, {ours['preset']} ({ours['params']:,} params, {ours['buckets']} buckets), "
          f"per step per rank, {len(ours['times'])} timed steps each:")
    print(f"  {'arm':<34} {'sent (ring)':>12} {'minimum':>10} {'ratio':>7} {'link':>16} {'step median':>12}  spread")
    for name, label in (("ours", "ours: socompile ZeRO-2"), ("anchor", "anchor: torch DDP + AdamW")):
        r = rows[name]
        link = f"{str(r['grad_dtype'])[6:]}/{str(r['weight_dtype'])[6:]}"
        print(f"  {label:<34} {r['per_step'] / 1e6:9.4f} MB {r['minimum'] / 1e6:7.4f} MB {r['ratio']:7.4f} "
              f"{link:>16} {r['median_s'] * 1e3:9.1f} ms  {r['min_s'] * 1e3:.1f} .. {r['max_s'] * 1e3:.1f} ms")
    print(f"  minimum: socompile.distributed.volumes.zero_min_bytes = 2 (W-1)/W x params x bytes of the carried dtype "
          f"(grads/weights); ours hands reduce-scatter {ours['rs'] / 1e6:.3f} MB, all-gather {ours['ag'] / 1e6:.3f} MB")
    verdict = "ok" if ours["ratio"] <= 1.05 else "OVER the 1.05 target"
    print(f"  ours / minimum {ours['ratio']:.4f} ({verdict}); median step ours / anchor "
          f"{ours['median_s'] / rows['anchor']['median_s']:.2f}x")
    for line in paper_rows(simulate="--no-sim" not in argv):
        print(line)
    return 0 if ours["ratio"] <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
