"""Pieces every draft head is built from: the head's config, RMSNorm, RoPE, attention
projections with q/k norm, the SwiGLU MLP, and what a TTT forward returns.

Module names match the Llama/Qwen3 layers serving engines load (q_proj ... o_proj,
q_norm/k_norm, mlp.gate_proj/up_proj/down_proj)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DraftHeadConfig:
    """The shape of a draft head (any architecture); written to draft_config.json."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_vocab_size: int
    draft_vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qk_norm: bool = False
    num_aux_layers: int = 3
    num_layers: int = 1
    target_hidden_size: int | None = None  # null: hidden_size (the usual EAGLE-3 draft)
    # The architecture's own settings (DraftArch.options resolves them from draft.options),
    # e.g. a parallel drafter's mask token.
    options: dict = field(default_factory=dict)
    # The most tokens one round may draft (a parallel drafter's trained slots); None: any k.
    max_draft_tokens: int | None = None


@dataclass
class DraftOutput:
    logits: list[torch.Tensor]  # per TTT step, [B, T, Vd]
    hidden: list[torch.Tensor]  # per TTT step, [B, T, H]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, d], positions [T] or [B, T]."""
        freqs = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        if emb.dim() == 3:
            emb = emb[:, None]
        return x * emb.cos().to(x.dtype) + _rotate_half(x) * emb.sin().to(x.dtype)


class AttentionProjections(nn.Module):
    """q/k/v/o projections, optional q/k RMSNorm and RoPE; how keys are attended is the
    caller's (a TTT unroll, a causal sequence, or a decoding cache)."""

    def __init__(self, c: DraftHeadConfig, in_features: int):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(in_features, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.c.head_dim).transpose(1, 2)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """q, k, v [B, heads, T, d] with RoPE at ``positions`` ([T] or [B, T]); k and v
        repeated to the query heads."""
        q = self._heads(self.q_proj(x), self.c.num_heads)
        k = self._heads(self.k_proj(x), self.c.num_kv_heads)
        v = self._heads(self.v_proj(x), self.c.num_kv_heads)
        if self.c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        rep = self.c.num_heads // self.c.num_kv_heads
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def out(self, heads: torch.Tensor) -> torch.Tensor:
        """[B, h, T, d] attention output -> o_proj([B, T, h * d])."""
        b, h, t, d = heads.shape
        return self.o_proj(heads.transpose(1, 2).reshape(b, t, h * d))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer (Llama / Qwen3 names) around an attention module of the
    head's own kind; how that attention reads its keys is the caller's (``attend``)."""

    def __init__(self, c: DraftHeadConfig, attention: type[AttentionProjections]):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = attention(c, c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def step(self, h: torch.Tensor, attend) -> torch.Tensor:
        """``attend(x)`` maps the attention input to o_proj's output (training's full
        sequence or blocks, or decoding's KV cache)."""
        h = h + attend(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))
