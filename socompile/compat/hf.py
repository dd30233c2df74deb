"""Hugging Face ``transformers`` decoder models under the superoffload backend.

    from socompile.compat.hf import build_causal_lm, logits_loss
    model = build_causal_lm("llama")              # small config, random weights, no download
    cmodel = torch.compile(model, backend="superoffload")
    loss = logits_loss(cmodel(x), y)              # or model(input_ids=x, labels=...).loss

What socompile needs from such a model, and what these helpers set:
- any parameter dtype: fp32 parameters alias socompile's fp32 master; bf16 or fp16 ones keep a separate fp32
  master in host memory (``host_master="auto"``), as mixed-precision training does.
- ``use_cache=False``: training needs no KV cache, and a cache object in the outputs only adds graph inputs.
- dropout 0 when comparing with eager PyTorch: compiled and eager dropout draw different random masks, so a
  run with dropout trains fine but cannot be compared element by element (``check_model`` says so).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")


def tiny_config(family: str, *, vocab_size: int = 256, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, max_positions: int = 128, **overrides: Any):
    """A small ``transformers`` config of ``family`` for tests and demos: fp32, no cache, no dropout."""
    import transformers

    if family == "gpt2":
        cfg = dict(vocab_size=vocab_size, n_embd=hidden_size, n_layer=layers, n_head=heads,
                   n_positions=max_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                   summary_first_dropout=0.0,
                   bos_token_id=0, eos_token_id=0, use_cache=False)
        return transformers.GPT2Config(**{**cfg, **overrides})
    classes = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}
    if family not in classes:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    cfg = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
               max_position_embeddings=max_positions, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
               pad_token_id=0, use_cache=False)
    return getattr(transformers, classes[family])(**{**cfg, **overrides})


def build_causal_lm(family: str, attn_implementation: str = "sdpa", **config_overrides: Any) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(tiny_config(family))``: random weights, nothing downloaded."""
    import transformers

    config = tiny_config(family, **config_overrides)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def logits_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy from a ``CausalLMOutput`` (or a plain logits tensor) and target ids."""
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def check_model(model: torch.nn.Module) -> list[str]:
    """Reasons this model will not train well (or not comparably) under socompile; empty when none."""
    problems = []
    config = getattr(model, "config", None)
    if config is not None:
        if getattr(config, "use_cache", False):
            problems.append("config.use_cache=True: training needs no KV cache; set use_cache=False")
        drop = {k: v for k, v in config.to_dict().items()
                if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, float) and v > 0}
        if drop:
            problems.append(f"dropout {drop}: compiled and eager runs draw different masks, so they are not "
                            "comparable element by element (training itself is fine)")
    return problems
