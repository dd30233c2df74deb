"""socompile: SuperOffload as a torch.compile backend.

    opt = socompile.AdamW(model.parameters(), lr=3e-4, max_grad_norm=1.0)
    cmodel = torch.compile(model, backend="superoffload", options={"target": "gh200"})
"""
from .backend import OffloadError, SuperOffload, superoffload
from .checkpoint import load, save
from .optim import AdamW
from .options import OptionError, Options

__all__ = ["AdamW", "OffloadError", "OptionError", "Options", "SuperOffload", "load", "save", "superoffload"]
__version__ = "0.1.0"
