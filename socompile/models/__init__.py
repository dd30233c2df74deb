"""Embedded models: a Llama-style decoder with presets from ``tiny`` to ``llama-25b``."""
from .llama import PRESETS, Llama, LlamaConfig, build

__all__ = ["PRESETS", "Llama", "LlamaConfig", "build"]
