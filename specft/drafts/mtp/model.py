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

from specft.drafts.layers import (
    AttentionProjections,
    DecoderLayer,
    DraftHeadConfig,
    DraftOutput,
    RMSNorm,
)
from specft.drafts.vocab import register_vocab_buffers


class MtpAttention(AttentionProjections):
    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Causal attention over the step's whole sequence (training)."""
        q, k, v = self.qkv(x, positions)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                       scale=1.0 / math.sqrt(self.c.head_dim)))


class MtpBlock(DecoderLayer):
    def __init__(self, c: DraftHeadConfig):
        super().__init__(c, MtpAttention)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.step(x, lambda y: self.self_attn(y, positions))


class MtpDraft(nn.Module):
    architecture = "mtp"  # draft_config.json's architecture: the registry key

    def __init__(self, c: DraftHeadConfig, embed_tokens: torch.Tensor, draft_to_target: torch.Tensor,
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

    def start_hidden(self, aux_hidden: torch.Tensor | None, final_hidden: torch.Tensor) -> torch.Tensor:
        """Step 0's previous hidden: the target's final hidden state."""
        return final_hidden.to(self.eh_proj.weight.dtype)

    def step(self, emb: torch.Tensor, hidden: torch.Tensor, attend) -> torch.Tensor:
        """One MTP step around its attention, for training and decoding alike:
        ``attend(x)`` maps the attention input to o_proj's output."""
        return self.block.step(self.eh_proj(torch.cat([self.hnorm(hidden), self.enorm(emb)], -1)), attend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head["norm"](hidden) @ self.head_weight.to(hidden.dtype).T

    def attention_modules(self) -> list[MtpAttention]:
        return [self.block.self_attn]

    def decode_step(self, emb: torch.Tensor, hidden: torch.Tensor, attend) -> torch.Tensor:
        return self.step(emb, hidden, lambda x: attend(0, x))

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, final_hidden: torch.Tensor,
                steps: int) -> DraftOutput:
        hidden = self.start_hidden(aux_hidden, final_hidden)
        t = input_ids.shape[1]
        out = DraftOutput([], [])
        for j in range(steps):
            tokens = F.pad(input_ids[:, j + 1:], (0, j + 1), value=0)
            positions = torch.arange(j, t + j, device=input_ids.device)
            hidden = self.step(self.embed_tokens(tokens), hidden,
                               lambda x, p=positions: self.block.self_attn(x, p))
            out.hidden.append(hidden)
            out.logits.append(self.logits(hidden))
        return out
