"""The model's state_dict() / load_state_dict() with a separate host master (socompile.AdamW).

The parameters are views of the optimizer's flat device buffers, and the committed weights live in the host
master: flow parameters hold no bytes between uses, and a loaded stationary weight must reach the master too.
So the optimizer registers hooks on the modules that own its parameters (``ModelStateHooks``): state_dict()
gives flow parameters' committed weights, load_state_dict() puts loaded values into the host master, and
``assign=True`` (which would replace the views) is refused.
"""
from __future__ import annotations

import gc
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..runtime.flat_bucket import FlatBucket

if TYPE_CHECKING:
    from .adamw import AdamW


class _ModuleHook:
    """A state_dict / load_state_dict hook of a module that owns parameters of a socompile.AdamW with a separate
    host master. It holds the optimizer's hooks weakly (a module does not keep its optimizer alive; the
    optimizer's ``__del__`` removes the hooks) and a copy of it does nothing (``deepcopy(model)``: the copy's
    parameters are not the optimizer's)."""

    def __init__(self, hooks: "ModelStateHooks | None", method: str):
        self._hooks = weakref.ref(hooks) if hooks is not None else None
        self.method = method

    def __call__(self, module, *args):
        hooks = self._hooks() if self._hooks is not None else None
        if hooks is not None:
            return getattr(hooks, self.method)(module, *args)
        return None

    def __reduce__(self):
        return (_ModuleHook, (None, self.method))


def _owning_modules(params: list[nn.Parameter]) -> list[nn.Module]:
    """The modules whose own ``_parameters`` hold any of ``params`` (the optimizer is given parameters, not
    modules): one pass over the objects the garbage collector tracks, at construction."""
    wanted = {id(p) for p in params}
    return [obj for obj in gc.get_objects() if issubclass(type(obj), nn.Module)
            and any(id(p) in wanted for p in obj._parameters.values() if p is not None)]


def _holds_nothing(bucket: FlatBucket) -> bool:
    return bucket.flow and not bucket.weights.untyped_storage().nbytes()


def _sharded_flow_buckets(own) -> list[FlatBucket]:
    """The device-sharded flow buckets that hold none of their weights now, among ``own`` (``_own``'s entries),
    each once, in the order of their first parameter there (the same on every rank)."""
    out: list[FlatBucket] = []
    for _, _, bucket, _ in own:
        if bucket.device_shard is not None and _holds_nothing(bucket) and all(b is not bucket for b in out):
            out.append(bucket)
    return out


class ModelStateHooks:
    """The hooks one optimizer registered on the modules owning its parameters. The optimizer holds this object
    (and calls ``remove`` when it goes); this holds the optimizer weakly, so no reference cycle keeps it alive."""

    def __init__(self, optimizer: "AdamW"):
        self._optimizer = weakref.ref(optimizer)
        self._loading: dict[int, list] = {}   # id(module): loads in progress, from the pre- to the post-hook
        self._handles = []
        for module in _owning_modules(optimizer.all_params()):
            self._handles += [
                module.register_state_dict_post_hook(_ModuleHook(self, "state_dict_post")),
                module.register_load_state_dict_pre_hook(_ModuleHook(self, "load_pre")),
                module.register_load_state_dict_post_hook(_ModuleHook(self, "load_post"))]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _own(self, module: nn.Module, prefix: str, keys) -> list[tuple[str, nn.Parameter, FlatBucket, int]]:
        """(state dict key, parameter, bucket, segment) of ``module``'s own parameters that the optimizer
        holds with a separate device buffer, for the keys present."""
        opt = self._optimizer()
        if opt is None:
            return []
        out = []
        for name, p in module._parameters.items():
            slot = opt.param_slots.get(id(p)) if p is not None else None
            if slot is None or prefix + name not in keys:
                continue
            bucket, i = slot
            if bucket.mirror and bucket.weights is not None and bucket.params[i] is p:
                out.append((prefix + name, p, bucket, i))
        return out

    def state_dict_post(self, module, state_dict, prefix, local_metadata) -> None:
        """State dict post-hook: a flow parameter's entry (its storage holds 0 bytes between uses) becomes a
        fresh tensor of its committed value, the master cast to its dtype on its device (as the next fetch
        would give it); stationary weights are the device buffer itself, once its upload is waited for.
        A device-sharded flow bucket (device-side ZeRO: this rank holds 1/W of the master) is all-gathered as
        a fetch would (``materialized``), so every rank gets the full weights, as FSDP's full state dict does:
        a collective, so every rank of the group calls ``model.state_dict()``, in the same order."""
        own = self._own(module, prefix, state_dict)
        if own:
            self._optimizer().wait_pending()   # a CPU job step() did not wait for may still upload its weights
        gathered = _sharded_flow_buckets(own)
        for bucket in gathered:
            with bucket.materialized():
                for key, p, of, i in own:
                    if of is bucket:
                        state_dict[key] = p.detach().clone()
        for key, p, bucket, i in own:
            if any(bucket is b for b in gathered):
                continue
            if _holds_nothing(bucket):
                state_dict[key] = bucket.view(bucket.master, i).to(device=p.device, dtype=p.dtype, copy=True)
            else:
                bucket.wait_upload_on_compute()

    def load_pre(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                 error_msgs) -> None:
        """Load pre-hook: a flow parameter gets a temporary buffer of its own for torch's loader to copy into
        (its storage holds 0 bytes); a stationary one is loaded into its device buffer once the upload in
        flight there is done. The post-hook moves the loaded values into the host master."""
        own = self._own(module, prefix, state_dict)
        if not own:
            return
        if local_metadata.get("assign_to_params_buffers"):
            raise RuntimeError(
                "load_state_dict(..., assign=True) on a model trained by socompile.AdamW with a separate host "
                "master would replace the parameters, which are views of the optimizer's device buffers. Load "
                "without assign=True (the values are copied into the host master and the device copy), or use "
                "socompile.load(path, model, opt).")
        self._optimizer().wait_pending()
        loading = []
        for key, p, bucket, i in own:
            held = None
            if _holds_nothing(bucket):
                held, p.data = p.data, torch.empty_like(p)
            else:
                bucket.wait_upload_on_compute()
            loading.append((key, p, bucket, i, held))
        self._loading.setdefault(id(module), []).append((loading, error_msgs, len(error_msgs)))

    def load_post(self, module, incompatible_keys) -> None:
        stack = self._loading.get(id(module))
        if not stack:
            return
        loading, error_msgs, errors_before = stack.pop()
        if not stack:
            del self._loading[id(module)]
        failed = error_msgs[errors_before:]
        for key, p, bucket, i, held in loading:
            if not any(key in message for message in failed):   # torch's loader names the key it could not copy
                bucket.load_segment(i, p.detach())
            if held is not None:
                p.data = held   # the 0-byte view of the device buffer again
