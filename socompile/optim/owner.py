"""Which socompile optimizer owns a parameter: the backend finds the optimizer of a compiled graph this way.

The parameter holds a weak reference (it must not keep its optimizer alive). A plain weakref cannot be
pickled, which made ``torch.save(model)`` fail, so ours pickles as "no owner": a loaded model belongs to no
optimizer until one is built for it.

NOTE: takeover. A parameter belongs to one socompile optimizer at a time, and the newest one wins: building a
second ``socompile.AdamW`` over a parameter (re-running a notebook cell, re-creating the optimizer after loading
a checkpoint) takes it over from the first, which then refuses to be used (``AdamW.hand_over``). Compiled
graphs are bound to the optimizer that owned their parameters when they were compiled; they compare
``ownership_token`` to notice a change of owner and compile again for the new one (socompile/per_model.py).
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .adamw import AdamW

_ATTR = "_socompile_owner"


class OwnerRef(weakref.ref):
    def __reduce__(self):
        return (_no_owner, ())


def _owner_none():
    return None


def _no_owner():
    return _owner_none


def owner_of(param: torch.Tensor):
    """The live socompile optimizer that owns ``param``, or None."""
    ref = getattr(param, _ATTR, None)
    return ref() if ref is not None else None


def ownership_token(param: torch.Tensor):
    """An object that is replaced whenever ``param`` changes owner (a new one per ``set_owner`` and
    ``release``): a compiled graph bound to one owner compares it by identity, which is cheap per call."""
    return getattr(param, _ATTR, None)


def previous_owners(params, optimizer) -> list:
    """The live socompile optimizers other than ``optimizer`` that own any of ``params`` (each once)."""
    found = {}
    for p in params:
        owner = owner_of(p)
        if owner is not None and owner is not optimizer:
            found[id(owner)] = owner
    return list(found.values())


def set_owner(param: torch.Tensor, optimizer) -> None:
    """Make ``optimizer`` the owner of ``param``. A previous owner must have handed it over first
    (``AdamW.hand_over``): a parameter belongs to one socompile optimizer at a time."""
    setattr(param, _ATTR, OwnerRef(optimizer))


def release(param: torch.Tensor, optimizer) -> None:
    """``param`` no longer belongs to ``optimizer`` (if it still did): it has no owner until one is built."""
    if owner_of(param) is optimizer:
        setattr(param, _ATTR, None)
