"""Training text that needs no download."""
from .stdlib_text import ByteBatches, stdlib_corpus

__all__ = ["ByteBatches", "stdlib_corpus"]
