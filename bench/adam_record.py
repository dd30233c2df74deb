"""bench/adam.py --record: the measured CPU Adam rates that socompile.hardware.cpu_adam reads."""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

from bench.adam_report import paired, summary


def _ratio_entry(alltimes, k, num, den) -> dict:
    """A paired ratio as stored: median and quartiles over the rounds."""
    median, q1, q3, _, _ = paired(alltimes, k, num, den)
    return {"median": round(median, 4), "quartiles": [round(q1, 4), round(q3, 4)]}


def _own_arguments(argv):
    """The command line as the user typed it (without the '--deepspeed-python ""' the re-run appends)."""
    return argv[:-2] if argv[-2:] == ["--deepspeed-python", ""] else argv


def record_rates(path, configs, alltimes, load0):
    """Store what socompile.hardware.cpu_adam reads: on the largest fp32 one-tensor configuration (ZeRO-Offload
    steps one flat fp32 partition with fp32 gradients; its casts are separate passes the simulator charges),
    ours' fraction of the streaming ceiling and the ZeRO-Offload kernel's bandwidth relative to ours, with
    DeepSpeedCPUAdam as that kernel when it ran, else torch's fused AdamW as a labelled stand-in."""
    fp32_one = [k for k in configs if k[1] == 1 and k[2] == "fp32" and (k, "ours in-place") in alltimes
                and (k, "ceiling in-place") in alltimes]
    if not fp32_one:
        raise SystemExit("--record needs an fp32 configuration with --tensors 1 and the methods 'ours in-place' "
                         "and 'ceiling in-place'")
    k = max(fp32_one)
    baseline = "deepspeed" if (k, "deepspeed") in alltimes else "torch fused"
    if (k, baseline) not in alltimes:
        raise SystemExit("--record needs 'deepspeed' or 'torch fused' among the methods")
    if baseline == "deepspeed":
        import deepspeed
        kernel = f"DeepSpeedCPUAdam (DeepSpeed {deepspeed.__version__}, its JIT-built CPU op)"
    else:
        kernel = (f"torch {torch.__version__} AdamW(fused=True), a stand-in: DeepSpeed did not run here "
                  f"(pass --deepspeed-python)")
    gbs = {name: round(summary(alltimes[(k, name)], k[0])[3], 2)
           for name in ("ours in-place", "ceiling in-place", "torch fused", "deepspeed") if (k, name) in alltimes}
    data = {
        "ours_of_ceiling": _ratio_entry(alltimes, k, "ceiling in-place", "ours in-place"),
        "baseline_of_ours": _ratio_entry(alltimes, k, "ours in-place", baseline),
        "torch_fused_of_ours": (_ratio_entry(alltimes, k, "ours in-place", "torch fused")
                                if (k, "torch fused") in alltimes else None),
        "baseline_kernel": kernel,
        "median_gb_per_s": gbs,
        "params": k[0], "rounds": len(alltimes[(k, "ours in-place")]),
        "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch CPU capability "
                   f"{torch.backends.cpu.get_cpu_capability()}, load average {load0:.1f} -> {os.getloadavg()[0]:.1f}",
        "command": shlex.join(["python", "bench/adam.py", *_own_arguments(sys.argv[1:])]),
    }
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    print(f"\nrecorded to {path}: ours {data['ours_of_ceiling']['median']:.2f} of the ceiling; ZeRO-Offload's kernel "
          f"({baseline}) {data['baseline_of_ours']['median']:.2f} of ours")
