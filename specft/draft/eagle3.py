"""The EAGLE-3 draft head.

fc fuses 3 target layers (3H -> H). Each draft step embeds the next token, concatenates
norm(embedding) and norm(hidden) (2H), runs one decoder layer whose q/k/v read 2H, and
predicts over a reduced draft vocabulary. Module names follow the EAGLE-3 checkpoints
that vLLM and SGLang load (fc, midlayer.*, norm, lm_head, d2t, t2d).

Training-time test (TTT) unrolls k steps: step j at position p reads token x[p+j+1] and
the draft's own hidden state from step j-1, sits at position p+j (RoPE uses the real
position, as in chain drafting), and attends to the step-0 keys at positions <= p plus
its own chain's keys from steps 1..j.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specft.draft.vocab import register_vocab_buffers


@dataclass
class Eagle3Config:
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


class Eagle3Attention(nn.Module):
    def __init__(self, c: Eagle3Config, in_features: int):
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
        q = self._heads(self.q_proj(x), self.c.num_heads)
        k = self._heads(self.k_proj(x), self.c.num_kv_heads)
        v = self._heads(self.v_proj(x), self.c.num_kv_heads)
        if self.c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        rep = self.c.num_heads // self.c.num_kv_heads
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def ttt_attention(self, q, keys: list, values: list) -> torch.Tensor:
        """q [B, h, T, d]; keys/values[0] are the step-0 (context) keys, attended
        causally; keys[1:] are this chain's later steps, attended on the diagonal."""
        scale = 1.0 / math.sqrt(self.c.head_dim)
        t = q.shape[2]
        scores0 = (q @ keys[0].transpose(-1, -2)) * scale
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores0 = scores0.masked_fill(~causal, float("-inf"))
        diag = [((q * k).sum(-1) * scale)[..., None] for k in keys[1:]]
        probs = torch.softmax(torch.cat([scores0, *diag], dim=-1), dim=-1)
        out = probs[..., :t] @ values[0]
        for i, v in enumerate(values[1:]):
            out = out + probs[..., t + i: t + i + 1] * v
        b, h, _, d = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h * d))


class Eagle3Layer(nn.Module):
    """A decoder layer with TTT attention. The first layer reads [norm(embedding);
    norm(hidden)] (2H); later layers (draft.num_layers > 1) read norm(hidden) (H)."""

    def __init__(self, c: Eagle3Config, first: bool = True):
        super().__init__()
        self.first = first
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c, (2 if first else 1) * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(c.hidden_size, c.intermediate_size, bias=False),
            "up_proj": nn.Linear(c.hidden_size, c.intermediate_size, bias=False),
            "down_proj": nn.Linear(c.intermediate_size, c.hidden_size, bias=False),
        })

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mlp
        return m["down_proj"](F.silu(m["gate_proj"](x)) * m["up_proj"](x))

    def forward(self, emb, hidden, positions, keys: list, values: list):
        """One TTT step; appends this step's k/v to ``keys``/``values``."""
        if self.first:
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        else:
            x = self.input_layernorm(hidden)
        q, k, v = self.self_attn.qkv(x, positions)
        keys.append(k)
        values.append(v)
        h = hidden + self.self_attn.ttt_attention(q, keys, values)
        return h + self._mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, c: Eagle3Config, embed_tokens: torch.Tensor, draft_to_target: torch.Tensor):
        super().__init__()
        self.config = c
        target_hidden = c.target_hidden_size or c.hidden_size
        self.fc = nn.Linear(c.num_aux_layers * target_hidden, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.extra_layers = nn.ModuleList(Eagle3Layer(c, first=False) for _ in range(c.num_layers - 1))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        if embed_tokens.shape[1] == c.hidden_size:
            # The target's embedding, frozen: copied, never trained.
            self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens.float().clone(), freeze=True)
        else:  # a draft narrower or wider than the target learns its own embedding
            self.embed_tokens = nn.Embedding(embed_tokens.shape[0], c.hidden_size)
            nn.init.normal_(self.embed_tokens.weight, std=0.02)
        register_vocab_buffers(self, draft_to_target, c.target_vocab_size)

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, final_hidden: torch.Tensor | None,
                steps: int) -> DraftOutput:
        """TTT unroll for steps 0..steps-1: draft logits [B, T, Vd] and hidden states
        [B, T, H]. Step j at position p predicts token x[p+j+2], i.e. matches the
        target's distribution at p+j+1."""
        hidden = self.fc(aux_hidden.to(self.fc.weight.dtype))  # bf16 training casts the module
        t = input_ids.shape[1]
        layers = [self.midlayer, *self.extra_layers]
        keys, values = [[] for _ in layers], [[] for _ in layers]  # per layer, per step
        out = DraftOutput([], [])
        for j in range(steps):
            tokens = F.pad(input_ids[:, j + 1:], (0, j + 1), value=0)
            positions = torch.arange(j, t + j, device=input_ids.device)
            emb = self.embed_tokens(tokens)
            for i, layer in enumerate(layers):
                hidden = layer(emb, hidden, positions, keys[i], values[i])
            out.hidden.append(hidden)
            out.logits.append(self.lm_head(self.norm(hidden)))
        return out
