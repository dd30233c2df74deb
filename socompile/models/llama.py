"""A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention.

Small enough to read in one sitting; the presets range from ``tiny`` (trains on two CPU cores in minutes)
to ``llama-28b`` (for planning only, traced under FakeTensorMode).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256          # byte-level text needs no tokenizer
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2            # grouped-query attention: n_heads must be a multiple of n_kv_heads
    ffn_dim: int | None = None     # None: ~8/3 * dim rounded up to a multiple of 64, as Llama does
    max_seq_len: int = 256
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def hidden_ffn_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return 64 * math.ceil(int(8 * self.dim / 3) / 64)

    def num_params(self) -> int:
        d, f, v, L = self.dim, self.hidden_ffn_dim, self.vocab_size, self.n_layers
        kv = d // self.n_heads * self.n_kv_heads
        per_layer = d * d * 2 + 2 * d * kv + 3 * d * f + 2 * d
        return L * per_layer + v * d * (1 if self.tie_embeddings else 2) + d


# Published shapes (Llama-2 7B/13B; 25B is the paper's largest single-GH200 model: 30 layers, hidden 8192).
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "tiny-tied": LlamaConfig(tie_embeddings=True),
    "small": LlamaConfig(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, max_seq_len=512),
    "llama-1b": LlamaConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                            ffn_dim=8192, max_seq_len=4096),
    "llama-7b": LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                            ffn_dim=11008, max_seq_len=4096),
    "llama-13b": LlamaConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                             ffn_dim=13824, max_seq_len=4096),
    "llama-25b": LlamaConfig(vocab_size=32000, dim=8192, n_layers=30, n_heads=64, n_kv_heads=64,
                             ffn_dim=22016, max_seq_len=4096),
    # llama-25b with 4 more layers (27.9B): past the paper's 25B on one GH200 (bench/paper.py, docs/planner.md)
    "llama-28b": LlamaConfig(vocab_size=32000, dim=8192, n_layers=34, n_heads=64, n_kv_heads=64,
                             ffn_dim=22016, max_seq_len=4096),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (even, odd) by position-dependent angles.
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"n_heads ({cfg.n_heads}) must be a multiple of n_kv_heads ({cfg.n_kv_heads})")
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeat = self.n_heads // self.n_kv_heads
        if repeat > 1:  # expand kv heads to the query heads (GQA)
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        hidden = cfg.hidden_ffn_dim
        self.w_gate = nn.Linear(cfg.dim, hidden, bias=False)
        self.w_up = nn.Linear(cfg.dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        # Buffers, not parameters: they move with the module but are never optimized.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def build(preset: str | LlamaConfig = "tiny", **overrides) -> Llama:
    """Build a preset by name (see PRESETS), optionally overriding config fields."""
    if isinstance(preset, LlamaConfig):
        cfg = preset
    else:
        if preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
        cfg = PRESETS[preset]
    return Llama(dataclasses.replace(cfg, **overrides))
