"""socompile.AdamW's own state_dict() / load_state_dict(): torch.optim.AdamW's layout, read from and written
into the flat buckets (the moments, the step counts and, for bf16 parameters, the fp32 host master)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..runtime.flat_bucket import flat_real, real_dtype

if TYPE_CHECKING:
    from .adamw import AdamW

# torch.optim.AdamW's param group keys that socompile.AdamW has no use for (its own key is "decoupled")
_TORCH_ONLY_KEYS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                    "decoupled_weight_decay")


def torch_param_group(group: dict) -> dict:
    """A param group of ``Optimizer.state_dict()`` (a fresh dict) in torch.optim.AdamW's keys."""
    decoupled = group.pop("decoupled", True)
    for key, value in (("amsgrad", False), ("maximize", False), ("foreach", None), ("capturable", False),
                       ("differentiable", False), ("fused", None)):
        group.setdefault(key, value)
    group["decoupled_weight_decay"] = decoupled
    return group


def save(opt: "AdamW") -> dict:
    """The body of ``AdamW.state_dict`` (see there)."""
    opt._wait_pending()
    if any(b.sharded for b in opt.buckets):
        raise RuntimeError("state_dict() of a ZeRO-sharded socompile.AdamW: this rank holds only its shards "
                           "of exp_avg/exp_avg_sq. Save with socompile.distributed.save(dir, model, opt) "
                           "(torch.distributed.checkpoint, every rank writes its shards), or gather "
                           "torch.optim.AdamW's layout on rank 0 with "
                           "socompile.distributed.full_optimizer_state_dict(opt).")
    # Read the buckets' *current* buffers: a ping-pong commit swaps them, so views taken earlier may point
    # at the spare. The step count lives in the bucket too.
    for p, state in opt.state.items():
        slot = opt._slot.get(id(p))
        if slot is None or "step" not in state:
            continue
        bucket, i = slot
        opt._alias_state(bucket, i, state)
        state["step"] = torch.tensor(float(bucket.steps[i]), dtype=torch.float32)
        if bucket.master.dtype != real_dtype(p.dtype):
            state["master"] = bucket.view(bucket.master, i)   # the fp32 weights the bf16 ones round
    out = torch.optim.Optimizer.state_dict(opt)
    out["param_groups"] = [torch_param_group(group) for group in out["param_groups"]]
    return out


def load(opt: "AdamW", state_dict) -> None:
    """The body of ``AdamW.load_state_dict`` (see there)."""
    opt._wait_pending()
    groups = []
    for n, group in enumerate(state_dict["param_groups"]):
        for key in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(key):
                raise ValueError(f"the state dict's param group {n} has {key}=True, which socompile.AdamW does "
                                 f"not implement; load it into torch.optim.AdamW, or train with {key}=False")
        group = {k: v for k, v in group.items() if k not in _TORCH_ONLY_KEYS}
        group["decoupled"] = state_dict["param_groups"][n].get(
            "decoupled", state_dict["param_groups"][n].get("decoupled_weight_decay", True))
        groups.append(group)
    # Separate host master: the parameters may have been loaded meanwhile (socompile.load loads the model
    # first): take the master from them before torch's loader runs (it casts "master" to the parameter's
    # dtype), then from the fp32 "master" this state dict may carry (bf16 parameters).
    masters = {}
    for n, saved in state_dict["state"].items():
        if isinstance(saved, dict) and isinstance(saved.get("master"), torch.Tensor):
            masters[n] = saved["master"]
    for bucket in opt.buckets:
        bucket.pull_from_weights()
    torch.optim.Optimizer.load_state_dict(opt, {"state": state_dict["state"], "param_groups": groups})
    order = [p for group in opt.param_groups for p in group["params"]]
    saved_ids = [k for group in state_dict["param_groups"] for k in group["params"]]
    raw = {}    # the saved moments as saved: torch's loader cast them to the parameter's dtype (bf16)
    for key, p in zip(saved_ids, order):
        slot = opt._slot.get(id(p))
        if key in masters and slot is not None and slot[0].mirror:
            bucket, i = slot
            bucket.view(bucket.master, i).copy_(masters[key].reshape(p.shape))
            bucket.master_changed()
        opt.state.get(p, {}).pop("master", None)
        if isinstance(state_dict["state"].get(key), dict):
            raw[id(p)] = state_dict["state"][key]
    # torch's loader put the saved tensors into opt.state: copy them into the buckets, then alias.
    for bucket in opt.buckets:
        for i, p in enumerate(bucket.params):
            state = opt.state.get(p)
            if not state or "step" not in state:
                bucket.state_part(bucket.exp_avg, i).zero_()
                bucket.state_part(bucket.exp_avg_sq, i).zero_()
                bucket.steps[i] = 0
                opt.state.pop(p, None)
                continue
            held = bucket.held(i)   # sharded: copy this rank's part of the whole moments
            for key, buffer in (("exp_avg", bucket.exp_avg), ("exp_avg_sq", bucket.exp_avg_sq)):
                if held is not None:   # flat and real (complex parameters: their real view), as the bucket
                    flat_real(bucket.state_part(buffer, i)).copy_(
                        flat_real(raw.get(id(p), state)[key])[held[0]:held[1]])
            opt._alias_state(bucket, i, state)
            bucket.steps[i] = int(float(state["step"]))
            state["step"] = torch.tensor(float(bucket.steps[i]), dtype=torch.float32)
    opt._upload(opt.buckets)
    opt.wait_uploads()
