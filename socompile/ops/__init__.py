"""socompile:: custom ops (each with a fake implementation) that passes insert into graphs."""
from . import optimizer_ops  # noqa: F401  (registers the ops)
from . import offload_ops  # noqa: F401
from . import activation_ops  # noqa: F401
