"""The Plan: every decision the planner makes, as frozen, JSON-serialisable data.

Passes only apply a Plan; they decide nothing. Same IR + hardware + options -> byte-identical JSON.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

# Per-layer activation choices (Plan.activations; passes/activations.py applies them), defined with the option.
from ..options import ACTIVATION_CHOICES, OFFLOADED_CHOICES  # noqa: F401

# How many layers ahead (in forward order) of an offloaded layer the backward starts copying its saved tensors
# back: one, the layer whose backward runs just before it. This is what the activation policy's time model
# assumes when it prices an offload (the copy in hides under the previous layer's backward,
# plan/activation_policy.py), so it is a decision of the planner, fixed rather than searched; the plan exposes it
# (Plan.activation_prefetch_ahead) and passes/activation_offload.py reads it from there.
ACTIVATION_PREFETCH_AHEAD = 1


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    index: int
    params: tuple[str, ...]        # in the order backward produces their gradients
    numel: int                     # elements of the bucket's gradients (unpadded)
    grad_bytes: int                # fp32 gradient bytes
    optimizer_site: str            # "cpu": stepped by the CPU worker; "device": stepped on the device
    ready_after: str               # bw node key after which all its gradients exist and no bw node reads its weights
    ready_position: int            # index of ready_after in backward execution order
    weight_mode: str = "stationary"  # "stationary": weights live on the device; "flow": streamed per use
    prefetch_distance: int = 0
    cast_site: str = "device"      # where fp32<->bf16 casts run
    link_dtype: str = "float32"    # precision of gradients crossing the link
    param_link_dtype: str = "float32"  # precision of updated weights crossing the link back to the device
    cast_reason: str = ""          # why the planner put the casts there (numbers from the profile)
    rollback: str = "exact"        # "exact": ping-pong optimizer state; "inverse": algebraic undo (host memory tight)
    layers: str = ""               # layer groups of its parameters, e.g. "layers.30-layers.31" (reports)
    ready_s: float = 0.0           # predicted: seconds from step start when its gradients start moving / stepping
    stepped_s: float = 0.0         # predicted: seconds from step start when its optimizer step has finished


@dataclasses.dataclass(frozen=True)
class Plan:
    target: str
    bucket_size: int
    buckets: tuple[BucketPlan, ...]
    unoptimized_params: tuple[str, ...]   # params with gradients but no socompile optimizer: keep .grad
    predicted: tuple[tuple[str, Any], ...] = ()   # named predictions (bytes, seconds) for the report
    recompute: str = "none"        # "none" or "layers": some repeated layer's activations are not kept
    decisions: tuple[str, ...] = ()   # one line per decision, with its reason (reports)
    # Per repeated layer group ("layers.3"): what happens to its saved activations between forward and backward:
    # "keep" (stay on the device), "recompute" (activation checkpointing: keep the layer's input, recompute
    # the rest in backward), "selective" (keep the input and the attention kernels' outputs, recompute the rest),
    # "selective_offload" (selective, with what it keeps in host memory between forward and backward) or
    # "offload" (saved tensors go to host memory in forward and come back in backward).
    # Empty: keep everything. passes/activations.py applies it.
    activations: tuple[tuple[str, str], ...] = ()

    @property
    def activation_prefetch_ahead(self) -> int:
        """Offloaded layers' saved tensors come back this many layers ahead (ACTIVATION_PREFETCH_AHEAD; a
        constant of the planner, so not a field of the JSON)."""
        return ACTIVATION_PREFETCH_AHEAD

    def activation_choice(self, layer: str) -> str:
        return dict(self.activations).get(layer, "keep")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        buckets = tuple(BucketPlan(**{**b, "params": tuple(b["params"])}) for b in data["buckets"])
        return cls(target=data["target"], bucket_size=data["bucket_size"], buckets=buckets,
                   unoptimized_params=tuple(data["unoptimized_params"]),
                   predicted=tuple(tuple(p) for p in data.get("predicted", ())),
                   recompute=data.get("recompute", "none"), decisions=tuple(data.get("decisions", ())),
                   activations=tuple(tuple(a) for a in data.get("activations", ())))

    def prediction(self, key: str, default: Any = None) -> Any:
        return dict(self.predicted).get(key, default)

    def bucket_of(self, param: str) -> BucketPlan:
        for bucket in self.buckets:
            if param in bucket.params:
                return bucket
        raise KeyError(param)
