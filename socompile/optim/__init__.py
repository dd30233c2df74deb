"""Optimizers whose steps the superoffload backend can place in the backward graph."""
from . import script_clip
from .adamw import AdamW

script_clip.install()   # a script's own clip_grad_norm_ sees the gradients socompile holds on the host

__all__ = ["AdamW"]
