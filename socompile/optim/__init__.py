"""Optimizers whose steps the superoffload backend can place in the backward graph."""
from .adamw import AdamW

__all__ = ["AdamW"]
