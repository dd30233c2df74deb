"""FX passes that apply a Plan. table.py lists them, in run order, with what each requires and provides."""
from . import activations  # noqa: F401  (the recompute re-partition; backend.py reaches it as passes.activations)
from .table import HOOKS, PASSES, known_pass_names, run_hooks, run_passes

__all__ = ["HOOKS", "PASSES", "known_pass_names", "run_hooks", "run_passes"]
