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
removes. A write that fails (a full disk) raises ``OSError`` with the OS's reason and the path, removes the
temporary file and leaves the previous checkpoint as it was.

Verified: the file records a crc32 of every tensor (format version 2, see ``integrity.py``), and ``load`` checks
before it changes anything that the file is complete, every tensor matches its checksum, the model's keys and
shapes fit the model, and the optimizer state is sound (moments finite and of their parameter's shape, second
moments >= 0, step counts non-negative integers). Refusals name the file and the entry. Files of version 1 (no
checksums, written before) still load, with a warning that their bytes cannot be verified; re-save them.
"""
from __future__ import annotations

import errno
import logging
import os
import pathlib
import pickle
import re
import tempfile
from typing import Any, Callable

import torch
from torch import nn

from . import integrity

FORMAT = "socompile-checkpoint"
VERSION = 2          # 2: per-tensor checksums ("checksums"); 1: none
_ENTRIES = ("model", "optimizer", "extra")
log = logging.getLogger("socompile")


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
        payload["checksums"] = {"algorithm": integrity.ALGORITHM,
                                "tensors": integrity.records({key: payload[key] for key in _ENTRIES})}
    _remove_stale_temps(folder, path.name)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=folder)
    try:
        _write(payload, fd, path)
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


def _write(payload: dict, fd: int, path: pathlib.Path) -> None:
    """torch.save + flush + fsync + close of file descriptor ``fd``; a failed write (full disk, quota, I/O
    error) raises OSError naming the path and the OS's reason, which torch's zip writer reports only as
    ``unexpected pos`` (the close, which flushes what is buffered, may fail the same way: it is inside)."""
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
    except (OSError, RuntimeError) as error:
        cause = _os_error_in(error)
        if cause is None:
            raise
        advice = (": free space on that device or save elsewhere" if cause.errno in (errno.ENOSPC, errno.EDQUOT)
                  else "")
        raise OSError(cause.errno, f"cannot write checkpoint {path}: {cause.strerror or cause}{advice}; "
                      "nothing was replaced: the previous checkpoint at that path, if any, is intact") from error


def _os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind ``error``: itself, or the one a C++ writer turned into a RuntimeError."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def load(path: str | os.PathLike, model: nn.Module | None = None, optimizer=None, *,
         strict: bool = True) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` into ``model`` and ``optimizer`` (either may be None);
    return the ``extra`` values. The optimizer may be ``socompile.AdamW`` or ``torch.optim.AdamW``.

    Everything is checked before anything is loaded (see the module docstring): a refused file changes neither
    the model nor the optimizer. Errors name the file and the entry: RuntimeError for a file that is empty, not
    a torch file, corrupt, cut short or does not fit the model; ValueError for a torch file that is not a
    socompile checkpoint and for optimizer values that cannot be right."""
    data = _read(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a socompile checkpoint (written by socompile.save): it holds "
                         f"{_described(data)}. Load it with torch.load and call load_state_dict yourself")
    if data.get("version", 0) > VERSION:
        raise ValueError(f"{path} has checkpoint format version {data['version']}, newer than this socompile "
                         f"reads ({VERSION}); upgrade socompile")
    _check_complete(path, data)
    _verify_checksums(path, data)
    if model is not None:
        if data["model"] is None:
            raise ValueError(f"{path} holds no model state (saved with model=None)")
        _check_model_entries(path, data["model"], _module(model), strict)
    if optimizer is not None:
        if data["optimizer"] is None:
            raise ValueError(f"{path} holds no optimizer state (saved with optimizer=None)")
        from .optim.state_dict import check_state_dict
        names = {id(p): name for name, p in _module(model).named_parameters()} if model is not None else None
        check_state_dict(data["optimizer"], optimizer.param_groups, names=names, source=f"checkpoint {path}")
    if model is not None:
        with _weights_of(optimizer, pull=True):   # values loaded into parameters go into a separate master
            _module(model).load_state_dict(data["model"], strict=strict)
    if optimizer is not None:
        _load_optimizer(optimizer, data["optimizer"])
    return dict(data.get("extra") or {})


def _described(data) -> str:
    """What a torch file that is not a checkpoint holds, for the refusal (a dict's first keys)."""
    if isinstance(data, dict):
        keys = list(data)
        return f"a dict with keys {keys[:8]}{' ...' if len(keys) > 8 else ''}"
    return f"a {type(data).__name__}"


def _load_optimizer(optimizer, state: dict) -> None:
    """load_state_dict; socompile.AdamW's would validate the state a second time (a pass over every moment),
    which ``load`` has just done before touching the model."""
    from .optim.adamw import AdamW
    if isinstance(optimizer, AdamW):
        optimizer.load_state_dict(state, checked=True)
    else:
        optimizer.load_state_dict(state)


def _read(path) -> Any:
    """torch.load(weights_only=True) of ``path``; a file it cannot read is reported with its path and what it
    is (empty, not a torch file, cut short or corrupt, a torch file of Python objects). torch's advice to retry
    with weights_only=False is never passed on: a file socompile.save wrote never needs it, and unpickling a
    file that is not one can run any code it holds."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as error:   # whatever the zip reader or unpickler trips over
        refusal = _unreadable(path, error)
        # torch's text (on the chained error a traceback prints too) gives the advice: leave it out then
        raise refusal from (None if _advises_unpickling(error) else error)


_ZIP_MAGIC = b"PK\x03\x04"                                                # torch.save's default format
_LEGACY_MAGIC = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)  # _use_new_zipfile_serialization=False


def _unreadable(path, error: Exception) -> Exception:
    """The refusal of a file torch.load(weights_only=True) failed on with ``error``."""
    size = os.path.getsize(path)
    if size == 0:
        return RuntimeError(f"checkpoint {path} is empty (0 bytes): nothing was written into it (a copy that "
                            "failed, or a file created empty; socompile.save never leaves one). Load an earlier "
                            "checkpoint, or copy it again")
    with open(path, "rb") as handle:
        head = handle.read(len(_LEGACY_MAGIC))
    if not head.startswith(_ZIP_MAGIC) and not head.startswith(_LEGACY_MAGIC):
        return RuntimeError(f"{path} is not a torch checkpoint: torch.save writes a zip archive (its first bytes "
                            f"{_ZIP_MAGIC!r}), this file of {size} bytes begins with {head[:12]!r}. Pass the path "
                            "of a file written by socompile.save")
    objects = _python_objects_in(path)
    if objects:
        return ValueError(f"{path} is not a socompile checkpoint: it is a torch file holding Python objects "
                          f"({', '.join(objects[:5])}{' ...' if len(objects) > 5 else ''}), where socompile.save "
                          "writes tensors, numbers, strings, lists, tuples and dicts, and socompile.load does not "
                          "unpickle objects (that can run code). If it was written by socompile.save, one of "
                          "its extra values was such an object: save plain values instead (e.g. its state dict)")
    return RuntimeError(f"checkpoint {path} ({size} bytes) cannot be read: {_reason(error)}. The file is cut "
                        "short or corrupt (an interrupted copy or a full disk while copying); load an earlier "
                        "checkpoint, or copy it again")


def _python_objects_in(path) -> list[str]:
    """The classes and functions a torch file's pickle names that weights_only does not load (read from its
    opcodes, not by unpickling); [] when there are none or the file is too damaged to tell."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:   # a damaged archive: reported as corrupt by the caller
        return []


def _advises_unpickling(error: Exception) -> bool:
    return "weights_only" in str(error) or "Weights only" in str(error)


def _reason(error: Exception) -> str:
    """torch's reason in one line, without its advice on weights_only."""
    text = str(error)
    if _advises_unpickling(error):
        found = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
        return f"its pickled data is damaged ({found.group(1).strip()})" if found else "its pickled data is damaged"
    return text.splitlines()[0] if text.strip() else type(error).__name__


def _check_complete(path, data: dict) -> None:
    for key in _ENTRIES:
        if key not in data:
            raise RuntimeError(f"checkpoint {path} is not complete: it has no {key!r} entry (socompile.save "
                               f"writes {', '.join(map(repr, _ENTRIES))}); the file was edited or written by "
                               "something else. Load an earlier checkpoint")
    optimizer = data["optimizer"]
    for key in ("state", "param_groups"):
        if optimizer is not None and (not isinstance(optimizer, dict) or key not in optimizer):
            raise RuntimeError(f"checkpoint {path} is not complete: its optimizer state has no {key!r} entry "
                               "(opt.state_dict() has 'state' and 'param_groups'); the file was edited or "
                               "written by something else. Load an earlier checkpoint")


def _verify_checksums(path, data: dict) -> None:
    sums = data.get("checksums")
    if data.get("version", 0) < 2 and sums is None:
        log.warning("checkpoint %s was written by an older socompile without checksums: its tensors cannot be "
                    "verified (only their values are checked). Save it again to add checksums.", path)
        return
    if not isinstance(sums, dict) or sums.get("algorithm") != integrity.ALGORITHM:
        raise RuntimeError(f"checkpoint {path} is corrupt: its 'checksums' entry is missing or unreadable "
                           f"(expected {integrity.ALGORITHM} sums). Load an earlier checkpoint")
    integrity.verify(f"checkpoint {path}", {key: data[key] for key in _ENTRIES}, sums.get("tensors") or {})


def _check_model_entries(path, saved: dict, module: nn.Module, strict: bool) -> None:
    """The saved model state fits the module (keys when ``strict``, shapes always), checked before any is
    copied: torch's load_state_dict copies the entries that fit before it reports those that do not."""
    # shapes only: a flow parameter's entry is a fresh copy of its weights (the optimizer's state_dict hook),
    # dropped here before the load materializes them again
    expected = {key: tuple(value.shape) if isinstance(value, torch.Tensor) else None
                for key, value in module.state_dict().items()}
    if strict:
        missing = [key for key in expected if key not in saved]
        unexpected = [key for key in saved if key not in expected]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint {path} does not fit this model: missing keys {missing[:5]}"
                               f"{' ...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
                               f"{' ...' if len(unexpected) > 5 else ''}. Load it into the model it was saved "
                               "from, or pass strict=False to load only the entries that match")
    for key, value in saved.items():
        shape = expected.get(key)
        if shape is not None and isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
            raise RuntimeError(f"checkpoint {path}: model entry {key!r} has shape {tuple(value.shape)}, the "
                               f"model's {shape}. Load it into the model it was saved from")


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
