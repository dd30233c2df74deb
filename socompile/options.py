"""User options of the superoffload backend, validated in one place.

Options come from three places, merged in this order (later wins): the dataclass defaults, ``SOCOMPILE_*``
environment variables (HF Trainer and Accelerate can name a backend but pass no options), and the
``options=`` dict given to ``torch.compile``. Every source is validated alike: an unknown name, from the dict, the
keyword arguments or a ``SOCOMPILE_*`` variable, is an ``OptionError`` naming the closest valid option.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from typing import Any, Mapping

from .pass_names import DISABLEABLE

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

# What a repeated layer's saved activations can become (Plan.activations per layer; options.activations names one
# for every layer, or 'auto'). Defined here, the lowest module that the planner, the passes and this validation
# all import (plan/plan.py re-exports it: importing socompile.plan from here would be an import circle).
ACTIVATION_CHOICES = ("keep", "recompute", "selective", "selective_offload", "offload")
OFFLOADED_CHOICES = ("offload", "selective_offload")   # saved tensors (selective_offload: its checkpoints) to host


# SOCOMPILE_* environment variables that are not options: other parts of the project read them. Every other
# SOCOMPILE_* name must be an option (a misspelt one is an error, not ignored).
NOT_OPTIONS = {
    "SOCOMPILE_ISA": "socompile_ext/__init__.py: forces the CPU Adam kernel's SIMD path (docs/kernel.md)",
    "SOCOMPILE_PROFILE_DIR": "socompile/hardware/profiles.py: where `calibrate` stores this machine's profile",
    "SOCOMPILE_EMULATION_SEED": "socompile/runtime/emulated_cuda.py: seed of the emulated device's delays",
    "SOCOMPILE_EMULATION_MAX_DELAY_MS": "socompile/runtime/emulated_cuda.py: longest delay of a queued copy, in ms",
    "SOCOMPILE_DEEPSPEED_PYTHON": "bench/adam.py: the Python interpreter that has DeepSpeed, for the comparison",
}


class OptionError(ValueError):
    """An option is unknown, of the wrong type or out of range; the message names the fix."""


def parse_bytes(value: int | float | str, name: str = "size") -> int:
    """Accept 67108864, 64e6, "64MB", "64 MiB", "2GB" and return bytes."""
    if isinstance(value, bool):
        raise OptionError(f"{name} must be a byte count such as 67108864 or '64MB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise OptionError(f"{name} must be >= 0, got {value!r}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise OptionError(f"{name}: cannot read {value!r} as a size; write e.g. '64MB', '2GiB' or 67108864")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


@dataclasses.dataclass(frozen=True)
class Options:
    """Options of ``torch.compile(model, backend="superoffload", options={...})``."""

    target: str = "gh200"
    """Hardware profile the plan is made for (see ``socompile.hardware``); also on a CPU-only machine."""
    bucket_size: int | str | None = None
    """Bytes of fp32 gradients per optimizer bucket (the unit of CPU stepping and reduce-scatter); None: the
    planner chooses (64MB, or the largest smaller size whose floor fits the device budget: gradients and flow buffers live at once scale with the bucket)."""
    compute: str = "inductor"
    """Compiler for the forward/backward compute: 'inductor' (default) or 'eager' (FX interpreted, fast compile)."""
    runtime: str = "auto"
    """Device runtime: 'cuda', 'cpu', 'emulated' (the CUDA runtime on an emulated asynchronous device: a CPU model
    is treated as a CUDA one, copies land late; checks the GPU path without a GPU, docs/runtime.md) or 'auto'
    (CUDA when available, else the CPU). The optimizer reads SOCOMPILE_RUNTIME when it is built: set the variable
    rather than the option to emulate a whole script."""
    gpu_buckets: int | None = None
    """Pin the number of optimizer buckets kept on the device; None lets the planner choose."""
    disable_passes: tuple[str, ...] = ()
    """Names of FX passes (or compile hooks, e.g. 'check_plan_across_ranks') to skip, e.g.
    ('wait_uploads',). A pass that another enabled pass requires (socompile/passes/table.py) cannot be skipped
    alone, e.g. ('insert_optimizer_steps', 'cast_gradients'): the error names both."""
    check_graphs: str = "each_pass"
    """Check the rewritten graphs' invariants (socompile/passes/check.py) after every pass ('each_pass', naming the
    pass that broke one), once after each graph's last pass ('final'), or not at all ('off'). Each check is linear
    in the graph: 27 ms in all for the 4 backward passes of an offline llama-7b plan (5.5k nodes)."""
    dump_dir: str | None = None
    """If set, write graphs before/after each pass and the plan report into this folder."""
    device_memory_budget: int | str | None = None
    """Bytes the plan may put on the device; None means the target profile's device memory."""
    optimizer_threads: int | None = None
    """OpenMP threads of the CPU Adam kernel when it steps this compiled model's buckets (set for those calls
    only, then restored: other models keep theirs); None: the process's count (socompile_ext.set_num_threads,
    else OMP_NUM_THREADS, else all cores)."""
    speculate: bool = True
    """Start each CPU bucket's step as soon as its gradients are complete, before validation."""
    clipping: bool | None = None
    """Whether the training step clips gradients (socompile.AdamW's max_grad_norm set). With clipping every CPU
    step speculated during backward is redone after validation, and the planner optimises that step (its GPU
    bucket count and the rest), not the unclipped one. None: read from the optimizer that owns the compiled
    parameters; False when planning without one (python -m socompile plan: set it, or SOCOMPILE_CLIPPING=1, to
    plan a clipped run)."""
    host_master: str | None = None
    """Whether fp32 CPU parameters share the optimizer's fp32 master ('shared') or the master is a separate host
    copy ('separate'): socompile.AdamW's host_master, which the plan's host memory and CPU work follow. None: read
    from the optimizer that owns the compiled parameters; without one, 'shared' for fp32 parameters on the CPU
    runtime (the optimizer's 'auto'). Other runtimes always keep a separate master."""
    moment_dtype: str | None = None
    """The format of the CPU buckets' Adam moments the plan counts (host memory, CPU bytes per step): 'float32'
    'bfloat16' or 'int8' (socompile.AdamW's moment_dtype). None: read from the optimizer that owns the compiled
    parameters; 'float32' when planning without one (python -m socompile plan --moment-dtype)."""
    on_graph_break: str = "warn"
    """On a graph break inside the compiled region: 'warn' (log where, with the source line), 'error', 'ignore'."""
    recompile_warn_after: int = 4
    """Warn once when the same code has been recompiled this many times (a recompile storm); 0 turns it off."""
    weight_mode: str = "planned"
    """Where weights live: 'planned' (the planner streams only what must, to fit the budget), 'stationary' (every
    bucket's weights stay on the device), 'flow' (every CPU-stepped bucket's weights are fetched before each use
    and released after, in forward and again in backward), or 'flow:0,3' (exactly buckets 0 and 3 flow).
    Buckets stepped on the device never flow: their fp32 master lives there."""
    prefetch_distance: int | None = None
    """Pin every flow bucket's prefetch distance: fetch it when the flow bucket this many places earlier is
    first used (0: at its own first use, the transfer is not hidden). None: the planner's choice."""
    cast_site: str | None = None
    """Pin where weights are cast between the fp32 master and what crosses the link: 'device' (fp32 crosses,
    the device casts to the compute dtype) or 'cpu' (the CPU casts to bfloat16, bfloat16 crosses; fp16 for an
    fp16 model; an fp32 model then computes with bf16-rounded streamed weights). None: the planner's choice, the
    site with the faster simulated step (ties: 'cpu', half the link bytes)."""
    grad_link_dtype: str | None = None
    """Pin the precision of gradients crossing the link to the CPU: 'float32' or 'bfloat16' (cast on the device,
    before the copy; the CPU optimizer accumulates in fp32). None: the model's own dtype, but float32 for an fp16
    model (the CPU kernel reads fp32 or bf16 gradients; fp16 to fp32 is exact)."""

    activations: str = "auto"
    """What happens to each repeated layer's saved activations between forward and backward: 'auto' (the planner
    keeps them while they fit and checkpoints or offloads layers when they do not), 'keep', 'recompute'
    (activation checkpointing: keep each layer's input, recompute the layer in backward), 'selective' (keep each
    layer's input and its attention outputs, recompute the rest: no attention kernel runs twice),
    'selective_offload' (selective, with those checkpoints in host memory between forward and backward) or
    'offload' (saved tensors move to host memory in forward and back in backward), for every repeated layer."""
    activation_layers: dict[str, str] | None = None
    """Pin some repeated layers' activation choice by hand (experiments, tests): layer group -> 'keep',
    'recompute', 'selective', 'selective_offload' or 'offload', e.g. {'layers.0': 'recompute', 'layers.1':
    'offload'}; the layers not named get the planner's choice (as ``activations`` decides), and the rest of the
    plan is made for the mix. A name that is no repeated layer of the graph is an error when it is planned.
    Environment: SOCOMPILE_ACTIVATION_LAYERS=layers.0=recompute,layers.1=offload."""
    dp_degree: int = 1
    """Data-parallel degree the plan is made for: ZeRO shards optimizer state and fp32 masters over dp x sp
    ranks, gradients are reduce-scattered and updated weights all-gathered per bucket. Each rank traces its own
    micro-batch."""
    sp_degree: int = 1
    """Ulysses sequence-parallel degree the plan is made for: each rank holds seq/sp tokens' activations and
    computes attention for n_heads/sp heads, with all-to-alls around attention. The traced sequence is the
    whole sequence; the planner divides token work and activations by sp_degree."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(Options)
        for field in dataclasses.fields(self):
            _check_type(field.name, getattr(self, field.name), hints[field.name])
        if self.bucket_size is not None:
            object.__setattr__(self, "bucket_size", parse_bytes(self.bucket_size, "bucket_size"))
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise OptionError("bucket_size must be positive, e.g. '64MB'")
        if self.device_memory_budget is not None:
            object.__setattr__(self, "device_memory_budget",
                               parse_bytes(self.device_memory_budget, "device_memory_budget"))
        if self.on_graph_break not in ("warn", "error", "ignore"):
            raise OptionError(f"on_graph_break must be 'warn', 'error' or 'ignore', got {self.on_graph_break!r}")
        if self.optimizer_threads is not None and self.optimizer_threads < 1:
            raise OptionError(f"optimizer_threads must be >= 1 or None (the process's count), got "
                              f"{self.optimizer_threads}")
        if self.recompile_warn_after < 0:
            raise OptionError(f"recompile_warn_after must be >= 0, got {self.recompile_warn_after}")
        if self.runtime not in ("auto", "cpu", "cuda", "emulated"):
            raise OptionError(f"runtime must be 'auto', 'cpu', 'cuda' or 'emulated', got {self.runtime!r}")
        if self.compute not in ("inductor", "eager"):
            raise OptionError(f"compute must be 'inductor' or 'eager', got {self.compute!r}")
        if not (self.weight_mode in ("planned", "stationary", "flow") or re.fullmatch(r"flow:\d+(,\d+)*",
                                                                                         self.weight_mode)):
            raise OptionError(f"weight_mode must be 'planned', 'stationary', 'flow' or 'flow:<i>,<j>,...' (bucket "
                              f"indices), got {self.weight_mode!r}")
        if self.prefetch_distance is not None and self.prefetch_distance < 0:
            raise OptionError(f"prefetch_distance must be >= 0 or None, got {self.prefetch_distance}")
        if self.cast_site not in (None, "device", "cpu"):
            raise OptionError(f"cast_site must be 'device', 'cpu' or None, got {self.cast_site!r}")
        if self.grad_link_dtype not in (None, "float32", "bfloat16"):
            raise OptionError(f"grad_link_dtype must be 'float32', 'bfloat16' or None, got {self.grad_link_dtype!r}")
        if self.host_master not in (None, "shared", "separate"):
            raise OptionError(f"host_master must be 'shared', 'separate' or None (the optimizer's), got "
                              f"{self.host_master!r}")
        if self.moment_dtype not in (None, "float32", "bfloat16", "int8"):
            raise OptionError(f"moment_dtype must be 'float32', 'bfloat16', 'int8' or None (the optimizer's), got "
                              f"{self.moment_dtype!r}")
        if self.activations not in ("auto", *ACTIVATION_CHOICES):
            *most, last = map(repr, ("auto", *ACTIVATION_CHOICES))
            raise OptionError(f"activations must be {', '.join(most)} or {last}, got {self.activations!r}")
        if self.activation_layers is not None:
            object.__setattr__(self, "activation_layers", _checked_layer_choices(self.activation_layers))
        if self.dp_degree < 1 or self.sp_degree < 1:
            raise OptionError(f"dp_degree and sp_degree must be >= 1, got {self.dp_degree} and {self.sp_degree}")
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))
        unknown = sorted(set(self.disable_passes) - set(DISABLEABLE))
        if unknown:
            raise OptionError(f"disable_passes names unknown passes {unknown}; known: {list(DISABLEABLE)}")
        if self.check_graphs not in ("each_pass", "final", "off"):
            raise OptionError(f"check_graphs must be 'each_pass', 'final' or 'off', got {self.check_graphs!r}")

    @classmethod
    def resolve(cls, options: Mapping[str, Any] | "Options" | None = None,
                environ: Mapping[str, str] | None = None) -> "Options":
        """Merge defaults, ``SOCOMPILE_*`` environment variables and explicit options, then validate."""
        if isinstance(options, Options):
            return options
        merged: dict[str, Any] = dict(_from_environ(os.environ if environ is None else environ))
        for key in options or {}:
            _check_name(key, repr(key))
        merged.update(options or {})
        return cls(**merged)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _checked_layer_choices(pins: dict[str, str]) -> dict[str, str]:
    """A copy of option activation_layers, each layer name a string and each choice one of the allowed ones."""
    allowed = ", ".join(repr(c) for c in ACTIVATION_CHOICES)
    for layer, choice in pins.items():
        if not isinstance(layer, str) or not layer:
            raise OptionError(f"activation_layers: layer names are layer groups such as 'layers.0', got {layer!r}")
        if choice not in ACTIVATION_CHOICES:
            raise OptionError(f"activation_layers: layer {layer!r} has choice {choice!r}; allowed: {allowed}")
    return dict(pins)


def _layer_choices_from_env(name: str, raw: str) -> dict[str, str]:
    """'layers.0=recompute,layers.1=offload' -> {'layers.0': 'recompute', 'layers.1': 'offload'}."""
    out: dict[str, str] = {}
    for item in (s.strip() for s in raw.split(",") if s.strip()):
        layer, sep, choice = item.partition("=")
        if not sep:
            raise OptionError(f"SOCOMPILE_{name.upper()}: cannot read {item!r}; write layer=choice pairs separated "
                              f"by commas, e.g. layers.0=recompute,layers.1=offload")
        out[layer.strip()] = choice.strip()
    return out


def _check_name(name: str, shown: str, prefix: str = "") -> None:
    """Raise OptionError for a name that is no option, suggesting the closest valid one (spelt as the source
    spells it: ``prefix`` + upper case for environment variables)."""
    names = [f.name for f in dataclasses.fields(Options)]
    if name in names:
        return
    spelt = {n: (prefix + n.upper()) if prefix else repr(n) for n in names}
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {spelt[close[0]]}?" if close else f"valid options: {', '.join(spelt.values())}"
    if prefix:
        hint += f" (unset it if it is not meant for socompile; other SOCOMPILE_ variables: {', '.join(NOT_OPTIONS)})"
    raise OptionError(f"unknown superoffload option {shown}: {hint}")


def _from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    """SOCOMPILE_BUCKET_SIZE=32MB -> {'bucket_size': '32MB'}, typed by the field's annotation."""
    hints = typing.get_type_hints(Options)
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith("SOCOMPILE_") or key in NOT_OPTIONS:
            continue
        name = key[len("SOCOMPILE_"):].lower()
        _check_name(name, f"{key} (environment variable)", prefix="SOCOMPILE_")
        out[name] = _coerce_env(name, raw, hints[name])
    return out


def _coerce_env(name: str, raw: str, hint: Any) -> Any:
    args = typing.get_args(hint)
    if raw.lower() in ("none", "") and type(None) in args:
        return None
    if hint is bool or bool in args:   # bool, or bool | None (clipping)
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise OptionError(f"SOCOMPILE_{name.upper()} must be true/false, got {raw!r}")
    if typing.get_origin(hint) is tuple:
        return tuple(s.strip() for s in raw.split(",") if s.strip())
    if any(typing.get_origin(a) is dict for a in args):
        return _layer_choices_from_env(name, raw)
    if int in args or hint is int:
        try:
            return int(raw)
        except ValueError:
            if str in args:
                return raw
            raise OptionError(f"SOCOMPILE_{name.upper()} must be an integer, got {raw!r}") from None
    return raw


def _check_type(name: str, value: Any, hint: Any) -> None:
    origin = typing.get_origin(hint)
    allowed = typing.get_args(hint) if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) else (hint,)
    for kind in allowed:
        if kind is type(None) and value is None:
            return
        base = typing.get_origin(kind) or kind
        if base is tuple and isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
            return
        if base in (int, float) and isinstance(value, bool):
            continue
        if isinstance(base, type) and base is not tuple and isinstance(value, base):
            return
    want = " or ".join(getattr(k, "__name__", str(k)) for k in allowed)
    raise OptionError(f"superoffload option {name!r} must be {want}, got {type(value).__name__} {value!r}")
