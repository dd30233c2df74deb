"""Embedded models: a Llama-style decoder with presets from ``tiny`` to ``llama-25b``."""
from .llama import PRESETS, Llama, LlamaConfig, build
from .with_loss import WithLMLoss

__all__ = ["PRESETS", "Llama", "LlamaConfig", "WithLMLoss", "build"]
