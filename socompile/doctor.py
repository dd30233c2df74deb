"""`socompile doctor`: what this machine offers the offloaded optimizer step.

report() returns a plain-text report: torch version and CUDA availability, the CPU Adam kernel's SIMD path
(dispatched and available), its OpenMP threads and build flags, the NUMA node count, and the pinned-memory
limit (`ulimit -l`), which bounds how much host memory can be page-locked for fast host<->device copies.
Nothing here raises: a missing piece is reported as such.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path


def _torch_lines():
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - report, never raise
        return [f"torch: not importable ({type(e).__name__}: {e})"]
    lines = [f"torch: {torch.__version__}"]
    try:
        cuda = torch.cuda.is_available()  # safe on CPU builds, unlike streams or pin_memory()
        count = torch.cuda.device_count() if cuda else 0
        lines.append(f"CUDA available: {'yes, %d device(s)' % count if cuda else 'no'}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"CUDA available: unknown ({e})")
    lines.append(_runtime_line())
    lines.append(f"torch threads: {torch.get_num_threads()}, CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    return lines


def _runtime_line() -> str:
    """The device runtime a compile would use here (runtime/device.py resolve_runtime)."""
    try:
        from .runtime.device import RUNTIME_ENV, resolve_runtime
        kind = resolve_runtime()
    except Exception as e:  # noqa: BLE001 - an unknown SOCOMPILE_RUNTIME is reported, not raised
        return f"runtime: unknown ({e})"
    why = {"cpu": "no usable CUDA", "cuda": "CUDA available",
           "emulated": "the CUDA runtime on an emulated asynchronous device, docs/runtime.md"}[kind]
    source = f", set by {RUNTIME_ENV}" if os.environ.get(RUNTIME_ENV) else ""
    return f"runtime: {kind} ({why}{source})"


def _kernel_lines():
    try:
        import socompile_ext as se

        info = se.build_info()
    except Exception as e:  # noqa: BLE001
        return [f"CPU Adam kernel (socompile_ext): not available ({type(e).__name__}: {e}); "
                f"build it with `pip install --no-build-isolation --no-deps -e .`"]
    forced = os.environ.get("SOCOMPILE_ISA")
    return [
        f"CPU Adam kernel ISA: {info['isa']}" + (f" (forced by SOCOMPILE_ISA={forced})" if forced else " (best available)"),
        f"  available ISAs: {', '.join(info['available_isas'])} (compiled: {', '.join(info['compiled_isas'])})",
        f"  OpenMP threads: {info['num_threads']} (OpenMP {info['openmp']})",
        f"  build: gcc {info['compiler']}, flags: {info['compile_flags']}",
        f"  version: {info['version']}",
    ]


def _numa_nodes():
    nodes = Path("/sys/devices/system/node")
    try:
        count = sum(1 for p in nodes.iterdir() if p.name.startswith("node") and p.name[4:].isdigit())
    except OSError:
        return "unknown (no /sys/devices/system/node)"
    return str(count)


def _memlock_limit():
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError) as e:
        return f"unknown ({e})"

    def fmt(v):
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v // 1024} KiB"

    note = "" if soft == resource.RLIM_INFINITY else " (raise with `ulimit -l unlimited` to pin large buffers)"
    return f"{fmt(soft)} (hard {fmt(hard)}){note}"


def report() -> str:
    lines = [f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"]
    lines += _torch_lines()
    lines += _kernel_lines()
    lines.append(f"NUMA nodes: {_numa_nodes()}")
    lines.append(f"pinned memory limit (ulimit -l): {_memlock_limit()}")
    return "\n".join(lines)
