"""Integer handles for runtime objects that compiled graphs call into.

NOTE: why a handle table. Inserted nodes are ``torch.library`` custom ops, and a custom op's arguments can
only be tensors and scalars, so a graph names its runtime object by an int. The table holds weak
references only: it never keeps an optimizer alive, and a handle whose object is gone fails loudly.
"""
from __future__ import annotations

import itertools
import weakref

_objects: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_next = itertools.count(1)


def register(obj: object) -> int:
    handle = next(_next)
    _objects[handle] = obj
    return handle


def lookup(handle: int):
    obj = _objects.get(handle)
    if obj is None:
        raise RuntimeError(f"socompile runtime object #{handle} no longer exists: the optimizer that this "
                           "compiled graph was planned for was deleted. Create a new socompile.AdamW over the "
                           "model's parameters: the compiled model then compiles its graphs again for it.")
    return obj
