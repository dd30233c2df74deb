"""Training checkpoints: model, optimizer and your own values in one file, written atomically.

    socompile.save("ckpt.pt", model, opt, step=step)          # model may be the torch.compile'd module
    extra = socompile.load("ckpt.pt", model, opt)              # -> {"step": step}

The optimizer part is ``opt.state_dict()``, which for ``socompile.AdamW`` has ``torch.optim.AdamW``'s layout:
a checkpoint saved from either optimizer loads into the other. Files are read with
``torch.load(weights_only=True)``, so ``extra`` may hold tensors, numbers, strings, lists, tuples and dicts.

Atomic: the file is written under a temporary name in the target's folder, flushed and fsync'ed, renamed
over the target with ``os.replace`` (atomic on POSIX within one file system), and the folder is fsync'ed so
the rename itself survives a crash. A process killed at any moment leaves either the previous file or the new
one, never a torn one; at worst a ``.<name>.tmp-*`` file stays behind, which the next save of that name
removes.
"""
from __future__ import annotations

import os
import pathlib
import tempfile
from typing import Any, Callable

import torch
from torch import nn

FORMAT = "socompile-checkpoint"
VERSION = 1


def _module(model: nn.Module) -> nn.Module:
    """The user's module behind ``torch.compile`` (whose state_dict keys carry an ``_orig_mod.`` prefix)."""
    return getattr(model, "_orig_mod", model)


def save(path: str | os.PathLike, model: nn.Module | None = None, optimizer=None, *,
         _before_rename: Callable[[], None] | None = None, **extra: Any) -> pathlib.Path:
    """Write ``{"model", "optimizer", "extra"}`` to ``path`` atomically; return the path.

    Call it after ``opt.step()`` (not between backward and step: a bucket's step may still be in flight and
    its step count not yet committed). ``_before_rename`` is a test hook run after the data is on disk and
    before the rename."""
    path = pathlib.Path(path)
    folder = path.parent if str(path.parent) else pathlib.Path(".")
    folder.mkdir(parents=True, exist_ok=True)
    with _weights_of(optimizer):   # flow weights of a separate host master hold no bytes between uses
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "torch_version": str(torch.__version__),
            "model": _cloned(_module(model).state_dict(), optimizer) if model is not None else None,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "extra": extra,
        }
    _remove_stale_temps(folder, path.name)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        if _before_rename is not None:
            _before_rename()
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(folder)
    return path


def load(path: str | os.PathLike, model: nn.Module | None = None, optimizer=None, *,
         strict: bool = True) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` into ``model`` and ``optimizer`` (either may be None);
    return the ``extra`` values. The optimizer may be ``socompile.AdamW`` or ``torch.optim.AdamW``."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a socompile checkpoint (written by socompile.save); load it with "
                         "torch.load and call load_state_dict yourself")
    if data.get("version", 0) > VERSION:
        raise ValueError(f"{path} has checkpoint format version {data['version']}, newer than this socompile "
                         f"reads ({VERSION}); upgrade socompile")
    if model is not None:
        if data["model"] is None:
            raise ValueError(f"{path} holds no model state (saved with model=None)")
        with _weights_of(optimizer, pull=True):   # values loaded into parameters go into a separate master
            _module(model).load_state_dict(data["model"], strict=strict)
    if optimizer is not None:
        if data["optimizer"] is None:
            raise ValueError(f"{path} holds no optimizer state (saved with optimizer=None)")
        optimizer.load_state_dict(data["optimizer"])
    return dict(data.get("extra") or {})


def _weights_of(optimizer, pull: bool = False):
    """socompile.AdamW with a separate host master: every parameter holds its weights inside the block."""
    import contextlib
    hold = getattr(optimizer, "materialized_weights", None)
    return hold(pull=pull) if hold is not None else contextlib.nullcontext()


def _cloned(state: dict, optimizer) -> dict:
    """Tensors of flowing weights (their storage is given back after the block) are cloned; others as is."""
    flowing = {b.weights.untyped_storage().data_ptr() for b in getattr(optimizer, "buckets", ())
               if getattr(b, "flow", False) and b.weights is not None}
    flowing.discard(0)
    if not flowing:
        return state
    return {key: value.clone() if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in flowing
            else value for key, value in state.items()}


def _remove_stale_temps(folder: pathlib.Path, name: str) -> None:
    """Temporary files of this name left by a save that was killed (never the target itself)."""
    for stale in folder.glob(f".{name}.tmp-*"):
        try:
            stale.unlink()
        except OSError:
            pass


def _fsync_dir(folder: pathlib.Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:   # e.g. a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
