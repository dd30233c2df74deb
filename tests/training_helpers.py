"""Shared helpers: train a model with socompile and with the eager torch reference on the same data."""
from __future__ import annotations

import copy
import importlib.util
import pathlib
import sys
from typing import Callable

import torch
import torch.nn.functional as F

import socompile
from socompile.data import ByteBatches, stdlib_corpus

_TEXT = None


def bench_module(script: str):
    """``bench/<script>.py`` as a module (the benches are scripts, not a package), registered in sys.modules
    as ``bench_<script>`` so that its dataclasses can look their module up."""
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{script}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def batches(n: int, batch: int = 2, seq: int = 32, seed: int = 0):
    global _TEXT
    if _TEXT is None:
        _TEXT = stdlib_corpus(200_000)
    data = ByteBatches(_TEXT, batch, seq, seed)
    return [next(data) for _ in range(n)]


def use_emulated_device(monkeypatch) -> None:
    """Run the CUDA path on the emulated device (runtime/emulated_cuda.py) for this test: a fixed emulation
    seed, and no hazards left over from an earlier test."""
    from socompile.runtime.emulated_cuda import emulated_device
    monkeypatch.setenv("SOCOMPILE_RUNTIME", "emulated")
    monkeypatch.setenv("SOCOMPILE_EMULATION_SEED", "0")
    emulated_device(0).hazards.clear()


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def run_pair(make_model: Callable[[], torch.nn.Module], steps: int = 10, options: dict | None = None,
             opt_kwargs: dict | None = None, param_groups: Callable | None = None, accumulate: int = 1,
             clip: float | None = None, loss_fn=lm_loss, data=None, socompile_kwargs: dict | None = None):
    """Train the same model (same seed, same data) two ways; return (ours, reference, backend, optimizer).

    Reference: eager PyTorch, torch.optim.AdamW (+ clip_grad_norm_ when clip is set)."""
    torch.manual_seed(0)
    ours = make_model()
    ref = copy.deepcopy(ours)
    opt_kwargs = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **(opt_kwargs or {}))
    groups = (lambda m: m.parameters()) if param_groups is None else param_groups
    opt = socompile.AdamW(groups(ours), max_grad_norm=clip, grad_accumulation_steps=accumulate, **opt_kwargs,
                          **(socompile_kwargs or {}))
    ref_opt = torch.optim.AdamW(groups(ref), **opt_kwargs)
    # gpu_buckets=0 by default: small test models would otherwise be planned entirely onto the device.
    backend = socompile.SuperOffload({"compute": "eager", "gpu_buckets": 0, **(options or {})})
    cmodel = torch.compile(ours, backend=backend)
    data = data if data is not None else batches(steps * accumulate)
    for step in range(steps):
        for micro in range(accumulate):
            x, y = data[step * accumulate + micro]
            loss_fn(cmodel(x), y).backward()
            loss_fn(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
    return ours, ref, backend, opt


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-6, rtol: float = 0.0) -> None:
    """Default tolerance: see the module docstring of test_backend_training.py (torch's sqrt is not IEEE).
    ``a``'s weights are read as docs/runtime.md asks between steps, inside its optimizers'
    ``materialized_weights()``: on CUDA (and SOCOMPILE_RUNTIME=emulated) the last uploads may be in flight."""
    import contextlib

    from socompile.optim.owner import owner_of
    owners = {id(o): o for o in map(owner_of, a.parameters()) if o is not None}
    with contextlib.ExitStack() as stack:
        for opt in owners.values():
            stack.enter_context(opt.materialized_weights())
        for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
