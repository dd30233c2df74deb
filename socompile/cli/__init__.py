"""Command line: ``python -m socompile {demo,plan,dump,doctor}``."""
from __future__ import annotations

import argparse
import sys

from .args import CommandError, non_negative_int, positive_int, writable_file, writable_folder


def _cmd_demo(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="socompile demo", description="train the tiny model on stdlib text")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=positive_int, default=300)
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--seq", type=positive_int, default=128)
    parser.add_argument("--compute", default="inductor", choices=["inductor", "eager"])
    args = parser.parse_args(argv)
    from ..demo import run_demo
    losses = run_demo(args.preset, args.steps, args.batch, args.seq, compute=args.compute)
    return 0 if losses[-1] < losses[0] else 1


def _cmd_plan(argv: list[str]) -> int:
    try:
        from .plan_commands import cmd_plan
    except ImportError:
        cmd_plan = None
    if cmd_plan is not None:
        return cmd_plan(argv)
    parser = argparse.ArgumentParser(prog="socompile plan", description="plan report, no step run")
    parser.add_argument("--model", default="tiny", help="preset name or pkg.module:function")
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--seq", type=positive_int, default=256)
    parser.add_argument("--target", default="gh200")
    parser.add_argument("--bucket-size", default="64MB")
    parser.add_argument("--json", help="also write the plan as JSON to this path")
    args = parser.parse_args(argv)
    writable_file(args.json, "--json")
    from ..offline import plan_model
    from ..report import plan_json, plan_table
    ctx = plan_model(args.model, args.batch, args.seq, {"target": args.target, "bucket_size": args.bucket_size})
    print(plan_table(ctx.plan, len(ctx.ir.bw_order)))
    if args.json:
        with open(args.json, "w") as f:
            f.write(plan_json(ctx.plan))
    return 0


def _cmd_dump(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="socompile dump", description="graphs before/after every pass")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--seq", type=positive_int, default=64)
    parser.add_argument("--target", default="gh200")
    parser.add_argument("--bucket-size", default="1MB")
    parser.add_argument("--out", default="dumps")
    parser.add_argument("--weight-mode", default="planned",
                        help="planned | stationary | flow | flow:i,j (flow shows prefetch/release nodes; it streams "
                             "CPU-stepped buckets only, so pair it with --gpu-buckets 0 on small models)")
    parser.add_argument("--gpu-buckets", type=non_negative_int, default=None,
                        help="pin the number of device-stepped buckets")
    parser.add_argument("--fake", action=argparse.BooleanOptionalAction, default=None,
                        help="trace under FakeTensorMode without running (default: only for models other than "
                             "the small presets); real runs compile through the backend and show every pass")
    args = parser.parse_args(argv)
    writable_folder(args.out, "--out")   # before the compile, which would otherwise be lost
    from ..report import write_dumps
    options = {"target": args.target, "bucket_size": args.bucket_size, "weight_mode": args.weight_mode,
               "gpu_buckets": args.gpu_buckets}
    fake = args.fake if args.fake is not None else args.model not in ("tiny", "tiny-tied", "small")
    if fake:
        from ..offline import plan_model
        ctx = plan_model(args.model, args.batch, args.seq, options)
    else:
        ctx = _compile_once(args.model, args.batch, args.seq, options)
    written = write_dumps(ctx, args.out)
    print(f"wrote {len(written)} files to {args.out}/")
    for path in written:
        print(f"  {path}")
    return 0


def _compile_once(model: str, batch: int, seq: int, options: dict):
    """One forward+backward of a real model through the backend (eager compute): the context it compiled."""
    import torch

    from .. import AdamW, SuperOffload
    from ..offline import resolve_model_factory

    net = resolve_model_factory(model)()
    vocab = getattr(getattr(net, "cfg", None), "vocab_size", 256)
    opt = AdamW(net.parameters())  # a live socompile optimizer puts its nodes into the graphs
    backend = SuperOffload({**options, "compute": "eager"})
    tokens = torch.randint(0, vocab, (batch, seq))
    logits = torch.compile(net, backend=backend)(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    del opt
    return backend.compiled[0]


def _cmd_doctor(argv: list[str]) -> int:
    from ..doctor import report
    print(report())
    return 0


COMMANDS = {"demo": _cmd_demo, "plan": _cmd_plan, "dump": _cmd_dump, "doctor": _cmd_doctor}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = {}
    try:  # the planner adds calibrate/simulate when present
        from . import plan_commands as cli_commands
        extra = {name[4:]: fn for name, fn in vars(cli_commands).items()
                 if name.startswith("cmd_") and name[4:] not in COMMANDS}
    except ImportError:
        pass
    commands = {**COMMANDS, **extra}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(f"usage: python -m socompile {{{','.join(commands)}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return _run(argv[0], commands[argv[0]], argv[1:])


def _run(name: str, command, argv: list[str]) -> int:
    """Run one command; bad input ends as one line on stderr naming the cause and the fix, not a traceback.
    Usage errors (bad option values, unknown presets or targets: ValueError, OptionError and PlanError among
    them) exit 2 like argparse's; a file that cannot be written or read exits 1."""
    try:
        return command(argv)
    except CommandError as err:
        print(f"socompile {name}: {err}", file=sys.stderr)
        return err.exit_code
    except ValueError as err:
        print(f"socompile {name}: {err}", file=sys.stderr)
        return 2
    except OSError as err:   # e.g. a --target profile file that cannot be read
        path = f"{err.filename}: " if err.filename else ""
        print(f"socompile {name}: {path}{err.strerror or err}; check the paths given on the command line",
              file=sys.stderr)
        return 1
