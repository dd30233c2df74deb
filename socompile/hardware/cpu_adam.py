"""CPU Adam rates measured by ``bench/adam.py --record`` and how the profiles use them.

Two ratios are measured on the machine the project is developed on (cpu_adam_measured.json beside this file
holds them with the command, date, machine and load), both paired per round of the interleaved benchmark, on
one fp32 tensor far larger than the caches (what ZeRO-Offload steps: one flat fp32 partition per group):
- ``ours_of_ceiling``: socompile_ext's AdamW step over the copy ceiling (a pass with the step's loads and stores
  and no arithmetic), i.e. the fraction of the memory system's streaming rate our kernel reaches;
- ``baseline_of_ours``: ZeRO-Offload's CPU Adam (DeepSpeedCPUAdam; or torch's fused AdamW, named as a stand-in,
  when DeepSpeed could not run) over ours.
Both kernels are memory-bound, so the ratios carry over between machines: a profile's CPU Adam streams
``ours_of_ceiling x host_bandwidth`` (the profile's memory bandwidth taken as its streaming ceiling) and the
ZeRO-Offload arm ``baseline_of_ours`` times that (docs/planner.md, "CPU Adam rates").
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

from ..moment_format import moments_streamed

MEASURED_FILE = pathlib.Path(__file__).resolve().parent / "cpu_adam_measured.json"


@dataclasses.dataclass(frozen=True)
class MeasuredAdam:
    ours_of_ceiling: float    # our kernel's bandwidth / the streaming ceiling (at most 1)
    baseline_of_ours: float   # ZeRO-Offload's CPU Adam bandwidth / ours
    baseline_kernel: str      # what was measured as ZeRO-Offload's kernel
    measured_at: str
    command: str

    def describe(self) -> str:
        return (f"CPU Adam at {self.ours_of_ceiling:.2f} of the streaming ceiling, ZeRO-Offload's at "
                f"{self.baseline_of_ours:.2f} of ours ({self.baseline_kernel}; measured {self.measured_at})")


def load_measured(path: str | pathlib.Path = MEASURED_FILE) -> MeasuredAdam:
    """The recorded ratios; a missing or malformed file is an error naming the command that writes it."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
        ours = float(data["ours_of_ceiling"]["median"])
        baseline = float(data["baseline_of_ours"]["median"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RuntimeError(f"cannot read the measured CPU Adam rates from {path} ({type(err).__name__}: {err}); "
                           f"re-create it with bench/adam.py --record (docs/planner.md, 'CPU Adam rates')") from err
    if not (ours > 0 and baseline > 0):
        raise RuntimeError(f"{path}: the measured CPU Adam ratios must be > 0, got {ours} and {baseline}; "
                           f"re-run bench/adam.py --record")
    # A kernel cannot stream faster than a pass with its own loads and stores: above 1 is the noise of a
    # shared machine, so the fraction is capped at the ceiling itself.
    return MeasuredAdam(min(1.0, ours), baseline, str(data.get("baseline_kernel", "")),
                        str(data.get("measured_at", "")), str(data.get("command", "")))


MEASURED = load_measured()


def adam_kernel_bytes(elements: float, grad_bytes: int, writes_low_copy: bool, moment_bytes: float = 4
                      ) -> tuple[float, float]:
    """(read, written) bytes of one fused AdamW pass over ``elements``: the fp32 master, the gradient and both
    moments read; master and moments written, and the 2-byte weight copy where the kernel writes it. The one
    formula the simulator's CPU task, the calibration and the runtime's host-work ledger all use."""
    moments = moments_streamed(moment_bytes, elements)   # int8 blocks: whole blocks with their scales
    read = elements * (4 + grad_bytes) + moments
    written = elements * (4 + (2 if writes_low_copy else 0)) + moments
    return read, written


def cpu_adam_bandwidth(host_bandwidth: float) -> float:
    """Bytes/s our CPU Adam streams on a host whose memory streams ``host_bandwidth``."""
    return MEASURED.ours_of_ceiling * host_bandwidth
