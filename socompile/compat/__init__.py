"""Helpers for models and training loops socompile did not write (Hugging Face transformers).

Nothing here imports a third-party package at import time: ``TORCH_LOGS=+socompile`` makes torch import every
socompile subpackage while torch itself is still importing.
"""
