"""DeepSpeed-Ulysses sequence parallelism for ``socompile.models.llama``.

Each of the P ranks of the sequence-parallel group holds S/P consecutive tokens of every sequence. Everything
but attention works token by token, so it runs on the local shard unchanged. Attention needs every position,
so around it two all-to-alls trade the split::

    q, k, v = wq(x), wk(x), wv(x)                  # (b, S/P, heads, d)       sequence shard, all heads
    q, k, v = all_to_all(q), ..(k), ..(v)          # (b, S, heads/P, d)       whole sequence, head shard
    q, k = rope(q, pos 0..S-1), rope(k, ...)       # global positions: the sequence is whole here
    o = sdpa(q, k, v, causal)                      # (b, heads/P, S, d)
    o = all_to_all(o)                              # (b, S/P, heads, d)       back to the sequence shard
    return wo(o)

RoPE is applied after the first all-to-all, where each rank holds positions 0..S-1 of its heads, so the
positions are the global ones by construction (no per-rank offset to get wrong) and the work is split by heads.

Grouped-query attention: query head j reads kv head j // (heads / kv_heads). Heads are split in contiguous
blocks, so rank r's query heads read exactly rank r's block of kv heads when kv_heads % P == 0. When it is not
(e.g. 2 kv heads over 4 ranks), kv heads are repeated by P / gcd(kv_heads, P) before the all-to-all, which keeps
the mapping and costs that factor in kv traffic. heads % P != 0 is an error.

The all-to-all is torch's functional collective with autograd (``all_to_all_single_autograd``), which Dynamo
traces, so the parallelized model also compiles (``torch.compile(model, backend="superoffload")``).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models.llama import Attention, Llama, apply_rope


class SequenceParallelError(ValueError):
    """The model or the batch cannot be split over the sequence-parallel group as asked."""


def _funcol():
    import torch.distributed._functional_collectives as funcol   # the traceable collectives
    return funcol


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Exchange equal dim-0 chunks: chunk j goes to rank j, chunk i of the result came from rank i."""
    funcol = _funcol()
    out = funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)
    return funcol.wait_tensor(out)


def seq_to_heads(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """(b, S/P, h, d) sequence shard -> (b, S, h/P, d) head shard."""
    b, s, h, d = x.shape
    chunks = x.view(b, s, world, h // world, d).permute(2, 0, 1, 3, 4)          # (P, b, S/P, h/P, d)
    got = _all_to_all(chunks, group)                                             # chunk i: sequence shard i
    return got.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)


def heads_to_seq(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """(b, S, h/P, d) head shard -> (b, S/P, h, d) sequence shard."""
    b, s_full, h_local, d = x.shape
    s = s_full // world
    chunks = x.view(b, world, s, h_local, d).permute(1, 0, 2, 3, 4)            # (P, b, S/P, h/P, d)
    got = _all_to_all(chunks, group)                                             # chunk i: head block i
    return got.permute(1, 2, 0, 3, 4).reshape(b, s, world * h_local, d)


def check_heads(n_heads: int, n_kv_heads: int, world: int) -> int:
    """Return the factor kv heads are repeated by before the all-to-all (1 when kv_heads % world == 0)."""
    if n_heads % world:
        raise SequenceParallelError(
            f"Ulysses splits attention heads over the sequence-parallel group: n_heads={n_heads} is not "
            f"divisible by sp={world}. Choose sp among the divisors of {n_heads}.")
    return world // math.gcd(n_kv_heads, world)


class UlyssesAttention(nn.Module):
    """Drop-in for ``llama.Attention`` on a sequence shard. Keeps the same projection modules (same parameter
    names, same state_dict) and ignores the (local) RoPE tables the model passes in, using the full ones."""

    def __init__(self, attn: Attention, group, rope_cos: torch.Tensor, rope_sin: torch.Tensor):
        super().__init__()
        self.group = group
        self.world = dist.get_world_size(group)
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.kv_repeat = check_heads(self.n_heads, self.n_kv_heads, self.world)
        self.wq, self.wk, self.wv, self.wo = attn.wq, attn.wk, attn.wv, attn.wo
        # The model's full tables (shared, not copied); not persistent, so the state_dict is unchanged.
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        if self.kv_repeat > 1:
            k, v = k.repeat_interleave(self.kv_repeat, dim=2), v.repeat_interleave(self.kv_repeat, dim=2)
        q, k, v = (seq_to_heads(t, self.group, self.world).transpose(1, 2) for t in (q, k, v))
        full = q.shape[2]
        if full > self.rope_cos.shape[0]:
            raise SequenceParallelError(f"global sequence length {full} exceeds max_seq_len {self.rope_cos.shape[0]}")
        cos_g, sin_g = self.rope_cos[:full], self.rope_sin[:full]
        q, k = apply_rope(q, cos_g, sin_g), apply_rope(k, cos_g, sin_g)
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)            # (b, h/P, S, d)
        out = heads_to_seq(out.transpose(1, 2), self.group, self.world)         # (b, S/P, h, d)
        return self.wo(out.reshape(b, s, -1))


def parallelize(model: Llama, sp_group) -> Llama:
    """Make ``model`` (a socompile Llama) run on sequence shards over ``sp_group``, in place, and return it.

    Feed each rank its shard (``shard_sequence``); the model returns the logits of its shard. Parameters keep
    their names. Their gradients are partial (from the local tokens): reduce them over every rank that saw
    different tokens (socompile.distributed.zero does; or ``average_gradients(params, world_group)``).
    """
    if not isinstance(model, Llama):
        raise TypeError(f"parallelize expects a socompile.models.llama.Llama, got {type(model).__name__}")
    world = dist.get_world_size(sp_group)
    check_heads(model.cfg.n_heads, model.cfg.n_kv_heads, world)   # fail before touching the model
    if world == 1:
        return model
    for block in model.layers:
        if not isinstance(block.attn, UlyssesAttention):
            block.attn = UlyssesAttention(block.attn, sp_group, model.rope_cos, model.rope_sin)
    return model


def shard_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """This rank's consecutive slice of ``x`` along the sequence dimension."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % world:
        raise SequenceParallelError(f"sequence length {x.shape[dim]} is not divisible by sp={world}; pad it")
    return x.chunk(world, dim=dim)[rank]


def gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Inverse of shard_sequence (no autograd): the whole sequence on every rank, e.g. for checks."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
