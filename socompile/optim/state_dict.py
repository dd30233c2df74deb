"""socompile.AdamW's own state_dict() / load_state_dict(): torch.optim.AdamW's layout, read from and written
into the flat buckets (the moments, the step counts and, for bf16 parameters, the fp32 host master)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from ..integrity import bad_values, is_step_count
from ..runtime.int8_moments import round_seed
from ..runtime.flat_bucket import real_dtype
from .bucket_layout import alias_state

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


# Per-parameter tensors of torch.optim.AdamW's state (and socompile's fp32 "master"): the parameter's shape;
# the second moments are averages of squares, so never negative.
_MOMENTS = {"exp_avg": False, "exp_avg_sq": True, "max_exp_avg_sq": True, "master": False}


def check_state_dict(state_dict, param_groups: list[dict], *, names: dict[int, str] | None = None,
                     source: str = "the optimizer state dict") -> None:
    """Refuse (ValueError, before anything is loaded) a state dict that would load wrong values into an
    optimizer over ``param_groups``: missing entries, a param group of another size, a moment of another shape
    than its parameter (a transposed one has the same number of elements), non-finite or negative second
    moments, a step count that is not a non-negative integer. ``names``: id(parameter) -> its name, for the
    messages; ``source`` starts them (e.g. the checkpoint's path)."""
    if isinstance(state_dict, (str, os.PathLike)):
        raise TypeError(f"load_state_dict takes a state dict, not a path ({state_dict}): for a file written by "
                        "socompile.save call socompile.load(path, model, opt); for torch.save(opt.state_dict()) "
                        "pass torch.load(path, weights_only=True)")
    if isinstance(state_dict, dict) and "optimizer" in state_dict and "state" not in state_dict:
        raise ValueError(f"{source} is socompile.save's whole checkpoint (model, optimizer and extra values): "
                         "pass its ['optimizer'] entry to load_state_dict, or call socompile.load(path, model, opt)")
    for key in ("state", "param_groups"):
        if not isinstance(state_dict, dict) or key not in state_dict:
            raise ValueError(f"{source} has no {key!r} entry, so it is not a complete optimizer state_dict (cut "
                             "short, or not made by opt.state_dict()); load a complete one")
    saved_groups, state = state_dict["param_groups"], state_dict["state"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"{source} has {len(saved_groups)} param group(s), the optimizer {len(param_groups)}: "
                         "build the optimizer with the param groups it was saved with")
    parameter_of = {}
    for n, (saved, mine) in enumerate(zip(saved_groups, param_groups)):
        if not isinstance(saved, dict) or "params" not in saved:
            raise ValueError(f"{source}: param group {n} has no 'params' entry, so it is not a complete optimizer "
                             "state_dict; load a complete one")
        if len(saved["params"]) != len(mine["params"]):
            raise ValueError(f"{source}: param group {n} has {len(saved['params'])} parameter(s), the optimizer's "
                             f"{len(mine['params'])}: build the optimizer over the model it was saved from")
        parameter_of.update(zip(saved["params"], mine["params"]))
    for index, entry in state.items():
        p = parameter_of.get(index)
        if p is None or not isinstance(entry, dict):
            continue
        owner = f" (parameter {names[id(p)]!r})" if names and id(p) in names else ""
        _check_entry(source, f"state[{index}]", owner, entry, p)


def _check_entry(source: str, label: str, owner: str, entry: dict, p: torch.Tensor) -> None:
    for key, nonnegative in _MOMENTS.items():
        value = entry.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.shape != p.shape:
            found = f"has shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
                f"is a {type(value).__name__}, not a tensor"
            raise ValueError(f"{source}: {label}.{key}{owner} {found}, its parameter {tuple(p.shape)} (a state "
                             "of another model, or edited); load the checkpoint saved with this model")
        problem = bad_values(value, nonnegative)
        if problem:
            why = ("second moments are averages of squares, never negative" if "negative" in problem else
                   "training diverged before the save, or the file was edited")
            raise ValueError(f"{source}: {label}.{key}{owner} {problem}; {why}: load an earlier checkpoint")
    if any(key in entry for key in _MOMENTS) and "step" not in entry:
        raise ValueError(f"{source}: {label}{owner} has moments but no 'step' (an incomplete state); load a complete "
                         "checkpoint")
    if "step" in entry:
        _check_step(source, f"{label}.step{owner}", entry["step"])


def _check_step(source: str, label: str, step) -> None:
    if not is_step_count(step):
        shown = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
        raise ValueError(f"{source}: {label} is {shown!r}; a step count must be a non-negative integer "
                         "(the file was edited or written by a broken optimizer): load an earlier checkpoint")


def save(opt: "AdamW") -> dict:
    """The body of ``AdamW.state_dict`` (see there)."""
    opt.wait_pending()
    if any(b.sharded for b in opt.buckets):
        raise RuntimeError("state_dict() of a ZeRO-sharded socompile.AdamW: this rank holds only its shards "
                           "of exp_avg/exp_avg_sq. Save with socompile.distributed.save(dir, model, opt) "
                           "(torch.distributed.checkpoint, every rank writes its shards), or gather "
                           "torch.optim.AdamW's layout on rank 0 with "
                           "socompile.distributed.full_optimizer_state_dict(opt).")
    # Read the buckets' *current* buffers: a ping-pong commit swaps them, so views taken earlier may point
    # at the spare. The step count lives in the bucket too.
    for p, state in opt.state.items():
        slot = opt.param_slots.get(id(p))
        if slot is None or "step" not in state:
            continue
        bucket, i = slot
        alias_state(bucket, i, state)
        state["step"] = torch.tensor(float(bucket.steps[i]), dtype=torch.float32)
        if bucket.master.dtype != real_dtype(p.dtype):
            state["master"] = bucket.view(bucket.master, i)   # the fp32 weights the bf16 ones round
    out = torch.optim.Optimizer.state_dict(opt)
    out["param_groups"] = [torch_param_group(group) for group in out["param_groups"]]
    # bf16 and int8 moments (moment_dtype): torch's layout is fp32, which torch.optim.AdamW loads (bf16 values
    # are exact in fp32; int8 blocks decode to the values the next step reads). The entries are fresh dicts:
    # opt.state keeps its views of the live buffers.
    if opt.moment_dtype != torch.float32:   # a float64 bucket keeps float64 moments: only bf16 and int8 convert
        index = {id(p): k for k, p in enumerate(p for group in opt.param_groups for p in group["params"])}
        out["state"] = dict(out["state"])
        for bucket in (b for b in opt.buckets if b.moments_rounded):
            for i, p in enumerate(bucket.params):
                k = index.get(id(p))
                if k in out["state"]:
                    exp_avg, exp_avg_sq = bucket.moment_values(i)
                    out["state"][k] = {**out["state"][k], "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    return out


def load(opt: "AdamW", state_dict, checked: bool = False) -> None:
    """The body of ``AdamW.load_state_dict`` (see there)."""
    opt.wait_pending()
    if not checked:   # before anything changes: a refused state loses nothing
        check_state_dict(state_dict, opt.param_groups)
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
        slot = opt.param_slots.get(id(p))
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
                bucket.moment_part(bucket.exp_avg, i).zero_()
                bucket.moment_part(bucket.exp_avg_sq, i).zero_()
                bucket.steps[i] = 0
                opt.state.pop(p, None)
                continue
            saved = raw.get(id(p), state)
            steps = int(float(state["step"]))
            bucket.set_moments(i, saved["exp_avg"], saved["exp_avg_sq"],
                               seed=round_seed(bucket.index, steps, bucket.offsets[i]))
            alias_state(bucket, i, state)
            bucket.steps[i] = steps
            state["step"] = torch.tensor(float(bucket.steps[i]), dtype=torch.float32)
    opt.upload_buckets(opt.buckets)
    opt.wait_uploads()
