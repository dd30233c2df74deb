"""Command-line logic of ``python -m socompile plan | calibrate | simulate`` (the dispatcher in
socompile/cli/__init__.py calls these).

    python -m socompile plan --model llama-25b --seq 4096 --batch 4 --target gh200 [--json P] [--html P]
    python -m socompile calibrate [--quick] [--out this-machine.json]
    python -m socompile simulate --model llama-13b --seq 4096 --batch 4 --target gh200 [--html P]

Each ``cmd_*`` takes argv (without the sub-command name) and returns an exit status.
"""
from __future__ import annotations

import dataclasses
import argparse
import pathlib
import resource
import sys
import time

from .args import non_negative_int, positive_int, writable_file
from ..options import ACTIVATION_CHOICES


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-7b",
                        help="preset name (tiny, small, llama-1b, llama-7b, llama-13b, llama-25b) or pkg.module:fn")
    parser.add_argument("--seq", type=positive_int, default=4096, help="sequence length (tokens)")
    parser.add_argument("--batch", type=positive_int, default=4, help="micro-batch size")
    parser.add_argument("--target", default="gh200",
                        help="hardware profile: gh200, gh200-144g, h100-pcie, a100-pcie, this-machine, or a file")
    parser.add_argument("--bucket-size", default=None, help="fp32 gradient bytes per bucket, e.g. 64MB")
    parser.add_argument("--gpu-buckets", type=non_negative_int, default=None,
                        help="pin the number of GPU-resident buckets")
    parser.add_argument("--budget", default=None, help="device memory budget, e.g. 80GB (default: the profile's)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="training dtype of weights and activations on the target (default bfloat16)")
    parser.add_argument("--formulas", action="store_true",
                        help="trace batch and seq symbolically so memory is reported as formulas (slower trace)")
    parser.add_argument("--no-fold", dest="fold", action="store_false",
                        help="trace every block (default: trace 4 identical blocks and repeat one; same plan, faster)")
    parser.add_argument("--activations", default=None,
                        choices=("auto", *ACTIVATION_CHOICES),
                        help="per-layer activation policy (default auto: keep what fits, offload or recompute the rest)")
    parser.add_argument("--moment-dtype", default=None, choices=("float32", "bfloat16", "int8"),
                        help="format of the CPU buckets' Adam moments (socompile.AdamW's moment_dtype; default "
                             "float32): bfloat16 holds 4 B of moments per parameter instead of 8, int8 2.5 B")
    parser.add_argument("--dp", type=positive_int, default=1, help="data-parallel degree (ZeRO over dp x sp ranks)")
    parser.add_argument("--sp", type=positive_int, default=1, help="Ulysses sequence-parallel degree (--seq is the whole "
                        "sequence; each rank holds seq/sp tokens)")
    parser.add_argument("--nodes", type=positive_int, default=None,
                        help="nodes the dp x sp ranks span (default: the profile's GPUs per node decide)")


def _plan(args):
    import torch

    from ..offline import plan_model
    options = {"target": args.target}
    if args.bucket_size:
        options["bucket_size"] = args.bucket_size
    if args.gpu_buckets is not None:
        options["gpu_buckets"] = args.gpu_buckets
    if args.budget:
        options["device_memory_budget"] = args.budget
    if args.activations:
        options["activations"] = args.activations
    if args.moment_dtype:
        options["moment_dtype"] = args.moment_dtype
    if args.dp != 1 or args.sp != 1:
        options["dp_degree"], options["sp_degree"] = args.dp, args.sp
    options["target"] = _target_for_nodes(args)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    return plan_model(_model_factory(args.model, args.seq), batch=args.batch, seq=args.seq, options=options,
                      dtype=dtype, symbolic=args.formulas, run_passes=False, fold=args.fold)


def _model_factory(model: str, seq: int):
    """A preset whose rotary tables cover ``seq`` (presets stop at 4096 positions); other models as given."""
    from ..models.llama import PRESETS
    if model in PRESETS and seq > PRESETS[model].max_seq_len:
        from ..models import build
        return lambda: build(model, max_seq_len=seq)
    return model


def _target_for_nodes(args) -> str:
    """--nodes N: the profile with gpus_per_node = ceil(dp*sp / N), written to a temporary profile file (the
    plan's target must be loadable by name or path, like every other target)."""
    if not args.nodes:
        return args.target
    import dataclasses
    import tempfile

    from ..calibrate import profile_for_target
    from ..hardware import save_profile
    hw = profile_for_target(args.target)
    per_node = max(1, -(-(args.dp * args.sp) // args.nodes))
    if per_node == hw.gpus_per_node:
        return args.target
    name = f"{hw.name}-x{per_node}"
    path = pathlib.Path(tempfile.gettempdir()) / f"socompile-{name}.json"
    save_profile(dataclasses.replace(hw, name=name, gpus_per_node=per_node), path)
    return str(path)


def _details(ctx):
    """The planner's details of the compile's own planning (the pipeline keeps them: nothing plans twice), for
    the plan the compile made (re-anchored on the final graphs)."""
    return dataclasses.replace(ctx.plan_details, plan=ctx.plan)


def cmd_plan(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="socompile plan",
                                     description="Plan a model for a target without running a step (FakeTensorMode).")
    _model_args(parser)
    parser.add_argument("--json", dest="json_path", default=None, help="write the plan as JSON here")
    parser.add_argument("--html", dest="html_path", default=None, help="write the HTML report with a timeline here")
    args = parser.parse_args(argv)
    writable_file(args.json_path, "--json")   # before planning, which would otherwise be lost
    writable_file(args.html_path, "--html")
    from ..plan.planner import PlanError
    from ..report import plan_html, plan_json, plan_table
    start = time.perf_counter()
    try:
        ctx = _plan(args)
    except PlanError as err:
        print(f"socompile plan: {err}", file=sys.stderr)
        return 2
    print(plan_table(ctx.plan, bw_length=len(ctx.ir.bw_order)))
    if args.json_path:
        pathlib.Path(args.json_path).write_text(plan_json(ctx.plan) + "\n")
    if args.html_path:
        from ..perf.simulate import simulate
        details = _details(ctx)
        sims = [details.simulation, details.zero_offload,
                simulate(details.plan, details.costs, details.cost, "zero-infinity")]
        pathlib.Path(args.html_path).write_text(plan_html(details.plan, sims, title=f"socompile plan: {args.model} "
                                                          f"seq {args.seq} batch {args.batch} on {args.target}"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"planned in {time.perf_counter() - start:.1f} s, peak RSS {rss:.0f} MB")
    return 0


def cmd_simulate(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="socompile simulate",
                                     description="Replay the plan, ZeRO-Offload and ZeRO-Infinity schedules.")
    _model_args(parser)
    parser.add_argument("--html", dest="html_path", default=None, help="write the timelines as HTML here")
    parser.add_argument("--trace", dest="trace_path", default=None,
                        help="write the timelines as a Chrome trace (JSON; open in Perfetto or chrome://tracing)")
    args = parser.parse_args(argv)
    writable_file(args.html_path, "--html")
    writable_file(args.trace_path, "--trace")
    from ..plan.planner import PlanError
    from ..perf import chrome_trace
    from ..perf.simulate import simulate
    from ..report import plan_html
    try:
        details = _details(_plan(args))
    except PlanError as err:
        print(f"socompile simulate: {err}", file=sys.stderr)
        return 2
    sims = [details.simulation, details.zero_offload,
            simulate(details.plan, details.costs, details.cost, "zero-infinity")]
    keys = ("step_time_s", "forward_s", "backward_s", "exposed_tail_s", "gpu_utilisation", "tflops", "mfu")
    print(f"{'schedule':<14}" + "".join(f"{k:>16}" for k in keys) + f"{'vs plan':>10}")
    for sim in sims:
        s = sim.summary()
        print(f"{sim.schedule:<14}" + "".join(f"{s[k]:>16}" for k in keys)
              + f"{sim.step_time / sims[0].step_time:>9.2f}x")
    if args.html_path:
        pathlib.Path(args.html_path).write_text(plan_html(details.plan, sims, title=f"socompile simulate: {args.model}"))
    if args.trace_path:   # one process per schedule, side by side
        chrome_trace.write(chrome_trace.merge(*(sim.chrome_trace(pid) for pid, sim in enumerate(sims, start=1))),
                           args.trace_path)
    return 0


def cmd_calibrate(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="socompile calibrate",
                                     description="Measure this machine and write a hardware profile.")
    parser.add_argument("--quick", action="store_true", help="smaller buffers: seconds, noisier")
    parser.add_argument("--out", default=None, help="profile file to write (default: the this-machine cache)")
    parser.add_argument("--name", default="this-machine")
    args = parser.parse_args(argv)
    writable_file(args.out, "--out")   # before measuring
    from ..calibrate import calibrate
    from ..hardware.profiles import profile_cache_path, save_profile
    profile = calibrate(quick=args.quick, name=args.name)
    path = save_profile(profile, args.out or profile_cache_path())
    for key, value in profile.to_dict().items():
        print(f"{key:>20}: {value}")
    print(f"wrote {path}")
    return 0
