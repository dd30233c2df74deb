"""FX passes that apply a Plan. Importing this package registers every pass, in run order."""
from . import insert_optimizer_steps  # noqa: F401
from . import weight_flow  # noqa: F401
from . import wait_uploads  # noqa: F401
from . import cast_gradients  # noqa: F401
from . import activations  # noqa: F401
from .registry import PASSES, known_pass_names, run_passes

__all__ = ["PASSES", "known_pass_names", "run_passes"]
