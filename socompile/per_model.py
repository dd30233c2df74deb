"""One compiled graph per model: the callable the backend gives Dynamo for a graph with parameters.

NOTE: why. Dynamo passes parameters as graph inputs (``inline_inbuilt_nn_modules``, torch's default) and
does not guard on their identity, so a second model of the same class (built fresh, or a ``copy.deepcopy``)
runs the code compiled for the first. Our graphs are bound to one optimizer: the backward names its buckets by
a GraphClaim handle (passes/insert_optimizer_steps.py) and the forward fetches flow weights from them. Run for
another model's parameters, they would step the first model's optimizer. So the backend returns a
``PerModelGraphs``: it looks at the parameters of each call and, the first time it sees parameters (or an
owning optimizer: optim/owner.py, takeover) it was not compiled for, compiles the Dynamo graph again for them,
so that each model gets its own plan, claim and buckets in its own optimizer. One compile per model, never
per step; parameters are held weakly (a compiled graph never keeps a model alive) and compared by identity
(a recycled ``id`` never matches a dead parameter's entry).
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

from .optim.owner import ownership_token


class _Compiled:
    """A compiled graph and the parameters (graph input index -> tensor) and owners it was compiled for."""

    def __init__(self, params: dict[int, torch.Tensor], fn: Callable):
        self.fn = fn
        self._params = [(index, weakref.ref(p), ownership_token(p)) for index, p in params.items()]

    def serves(self, inputs) -> bool:
        """The call's parameters are the very tensors this graph was compiled for, with the same owners."""
        for index, ref, token in self._params:
            p = inputs[index]
            if p is not ref() or ownership_token(p) is not token:
                return False
        return True

    def alive(self) -> bool:
        return all(ref() is not None for _, ref, _ in self._params)


class PerModelGraphs:
    """Dispatch each call to the graph compiled for its parameters; compile one for new parameters.

    ``compile_for(params)`` compiles the Dynamo graph again for ``params`` (graph input index -> parameter) and
    returns the compiled callable. Calls are passed on as they came: every graph comes from the same backend
    path, so all share one calling convention. That may be the boxed one (a single list of inputs), which the
    graphs advertise with ``_boxed_call``; but AOTAutograd's wrapper copies the flag from the boxed function it
    wraps while taking its inputs one by one, and Dynamo calls it so. A boxed call is therefore recognised by its
    form: graph inputs are tensors and numbers, never one list."""

    def __init__(self, params: dict[int, torch.Tensor], first: Callable,
                 compile_for: Callable[[dict[int, torch.Tensor]], Callable]):
        self._indices = list(params)
        self._compiled = [_Compiled(params, first)]
        self._compile_for = compile_for
        self._boxed_call = getattr(first, "_boxed_call", False)

    def __call__(self, *args):
        boxed = self._boxed_call and len(args) == 1 and isinstance(args[0], list)
        inputs = args[0] if boxed else args
        return self._graph_for(inputs).fn(*args)

    def _graph_for(self, inputs) -> _Compiled:
        for k, compiled in enumerate(self._compiled):
            if compiled.serves(inputs):
                if k:   # most recent first: a training loop finds its graph at the first try
                    self._compiled.insert(0, self._compiled.pop(k))
                return compiled
        params = {index: inputs[index] for index in self._indices}
        compiled = _Compiled(params, self._compile_for(params))
        # Graphs of models that are gone can never be called again: drop them.
        self._compiled = [compiled, *(c for c in self._compiled if c.alive())]
        return compiled
