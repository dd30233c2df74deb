"""Which socompile optimizer owns a parameter: the backend finds the optimizer of a compiled graph this way.

The parameter holds a weak reference (it must not keep its optimizer alive). A plain weakref cannot be
pickled, which made ``torch.save(model)`` fail, so ours pickles as "no owner": a loaded model belongs to no
optimizer until one is built for it.
"""
from __future__ import annotations

import weakref

import torch

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


def set_owner(param: torch.Tensor, optimizer) -> None:
    """Make ``optimizer`` the owner of ``param``; a parameter belongs to one socompile optimizer at most."""
    current = owner_of(param)
    if current is not None and current is not optimizer:
        raise ValueError("a parameter is already owned by another socompile optimizer; each "
                         "parameter may belong to one socompile optimizer only")
    setattr(param, _ATTR, OwnerRef(optimizer))
