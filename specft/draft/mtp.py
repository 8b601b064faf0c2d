"""A DeepSeek-V3 style multi-token-prediction (MTP) draft head.

Step j at position p: norm(previous hidden) and norm(embedding of token x[p+j+1]) are
concatenated and projected (2H -> H), run through one causal decoder layer over the
step's whole (shifted) sequence, and read out through the target's own lm_head (the
"shared head", frozen) restricted to the draft vocabulary. Step 0's previous hidden is
the target's final hidden state; step j > 0 chains the module's own output. Module
names follow DeepSeek's MTP layout: enorm, hnorm, eh_proj, block.*, shared_head.*.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specft.draft.eagle3 import DraftOutput, Eagle3Config, RMSNorm, Rotary
from specft.draft.vocab import register_vocab_buffers


class MtpAttention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """q, k, v [B, heads, T, d] with RoPE at ``positions`` ([T] or [B, T]); k and v
        repeated to the query heads."""
        b, t, _ = x.shape
        c = self.c

        def heads(y, n):
            return y.view(b, t, n, c.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x), c.num_heads), heads(self.k_proj(x), c.num_kv_heads), \
            heads(self.v_proj(x), c.num_kv_heads)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        rep = c.num_heads // c.num_kv_heads
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x, positions)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(self.c.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MtpBlock(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MtpAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(c.hidden_size, c.intermediate_size, bias=False),
            "up_proj": nn.Linear(c.hidden_size, c.intermediate_size, bias=False),
            "down_proj": nn.Linear(c.intermediate_size, c.hidden_size, bias=False),
        })

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), positions)
        m = self.mlp
        y = self.post_attention_layernorm(h)
        return h + m["down_proj"](F.silu(m["gate_proj"](y)) * m["up_proj"](y))


class MtpDraft(nn.Module):
    def __init__(self, c: Eagle3Config, embed_tokens: torch.Tensor, draft_to_target: torch.Tensor,
                 head_rows: torch.Tensor):
        super().__init__()
        self.config = c
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.block = MtpBlock(c)
        self.shared_head = nn.ModuleDict({"norm": RMSNorm(c.hidden_size, c.rms_norm_eps)})
        self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens.float().clone(), freeze=True)
        # The target's lm_head rows for the draft vocabulary (row i for draft token i):
        # frozen, shared with the target.
        self.register_buffer("head_weight", head_rows.float().clone())
        register_vocab_buffers(self, draft_to_target, c.target_vocab_size)

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, final_hidden: torch.Tensor,
                steps: int) -> DraftOutput:
        hidden = final_hidden.to(self.eh_proj.weight.dtype)
        t = input_ids.shape[1]
        out = DraftOutput([], [])
        for j in range(steps):
            tokens = F.pad(input_ids[:, j + 1:], (0, j + 1), value=0)
            positions = torch.arange(j, t + j, device=input_ids.device)
            x = self.eh_proj(torch.cat([self.hnorm(hidden), self.enorm(self.embed_tokens(tokens))], -1))
            hidden = self.block(x, positions)
            out.hidden.append(hidden)
            out.logits.append(self.shared_head["norm"](hidden) @ self.head_weight.to(hidden.dtype).T)
        return out
