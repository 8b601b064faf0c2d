"""The DFlash block drafter: k tokens denoised in one forward from the target's features.

The target's features at each context position p (its aux layers, concatenated) are fused
by ``fc`` and normalized by ``hidden_norm``; every decoder layer projects them into its own
context keys and values (k_norm and RoPE at p), with no draft layer run over them. A round
after context position e drafts one block: the token x[e+1] the target just chose, then k
mask tokens, at positions e+1 .. e+1+k. The block's tokens are embedded and run through the
decoder layers; each attends to the context positions <= e and to the whole block (not
causal within it). Mask slot i's output predicts x[e+1+i], the i-th drafted token.

Training scores a block at every context position e at once: slot i at e is matched
against the target's distribution at e+i, as EAGLE-3's step i-1 at e is, so the losses,
acceptance replay and metrics are shared. Names follow vLLM's DFlash checkpoints
(qwen3_dflash.py): fc, hidden_norm, layers.{i}.*, norm, lm_head, d2t, t2d; its layers
always carry q/k norm.
"""

from __future__ import annotations

import dataclasses
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


class DFlashAttention(AttentionProjections):
    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, heads, T, d] of fused target features at ``positions``,
        through this layer's own projections (repeated to the query heads)."""
        k = self._heads(self.k_proj(ctx), self.c.num_kv_heads)
        v = self._heads(self.v_proj(ctx), self.c.num_kv_heads)
        k = self.rotary(self.k_norm(k), positions)
        rep = self.c.num_heads // self.c.num_kv_heads
        return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def block_attention(attn: DFlashAttention, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor,
                    ctx_v: torch.Tensor) -> torch.Tensor:
    """Training: blocks x [B, T, S, H] at every context position e (slot s at position
    positions[e, s]) attend to the context keys at <= e and to their own block's S keys."""
    b, t, s, _ = x.shape
    q, k, v = attn.qkv(x.reshape(b, t * s, -1), positions.reshape(-1))
    q, k, v = (z.reshape(b, z.shape[1], t, s, -1) for z in (q, k, v))  # [B, h, T, S, d]
    scale = 1.0 / math.sqrt(attn.c.head_dim)
    to_context = torch.einsum("bhtsd,bhpd->bhtsp", q, ctx_k) * scale
    seen = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()  # context p <= e
    to_context = to_context.masked_fill(~seen[:, None, :], float("-inf"))
    to_block = torch.einsum("bhtsd,bhtud->bhtsu", q, k) * scale
    probs = torch.softmax(torch.cat([to_context, to_block], -1), -1)
    out = torch.einsum("bhtsp,bhpd->bhtsd", probs[..., :t], ctx_v) + torch.einsum(
        "bhtsu,bhtud->bhtsd", probs[..., t:], v)
    return attn.out(out.reshape(b, out.shape[1], t * s, -1)).reshape(b, t, s, -1)


class DFlashDraft(nn.Module):
    architecture = "dflash"  # draft_config.json's architecture: the registry key

    def __init__(self, c: DraftHeadConfig, embed_tokens: torch.Tensor, draft_to_target: torch.Tensor):
        super().__init__()
        c = dataclasses.replace(c, qk_norm=True)  # DFlash layers always norm q and k (vLLM builds them so)
        self.config = c
        self.fc = nn.Linear(c.num_aux_layers * (c.target_hidden_size or c.hidden_size), c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c, DFlashAttention) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        if embed_tokens.shape[1] == c.hidden_size:  # the target's embedding, frozen
            self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens.float().clone(), freeze=True)
        else:  # a draft of another width learns its own
            self.embed_tokens = nn.Embedding(embed_tokens.shape[0], c.hidden_size)
            nn.init.normal_(self.embed_tokens.weight, std=0.02)
        register_vocab_buffers(self, draft_to_target, c.target_vocab_size)
        self.mask_token_id = int(c.options["mask_token_id"])

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The fused, normalized target features every layer's context keys come from."""
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def block_embeddings(self, bonus: torch.Tensor, k: int) -> torch.Tensor:
        """[..., k+1, H]: the token after the context, then k mask tokens."""
        masks = torch.full((*bonus.shape, k), self.mask_token_id, dtype=torch.long, device=bonus.device)
        return self.embed_tokens(torch.cat([bonus[..., None], masks], -1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, final_hidden: torch.Tensor | None,
                steps: int) -> DraftOutput:
        """Blocks of ``steps`` mask slots at every context position: DraftOutput step j
        at position e is slot j+1 of the block after e (it predicts x[e+j+2])."""
        b, t = input_ids.shape
        ctx = self.context(aux_hidden)
        positions = torch.arange(t, device=input_ids.device)
        h = self.block_embeddings(F.pad(input_ids[:, 1:], (0, 1), value=0), steps)  # bonus x[e+1]
        slots = positions[:, None] + 1 + torch.arange(steps + 1, device=input_ids.device)  # [T, S]
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.context_kv(ctx, positions)
            h = layer.step(h, lambda x, a=layer.self_attn, ck=ctx_k, cv=ctx_v: block_attention(a, x, slots, ck, cv))
        logits = self.logits(h[:, :, 1:])
        return DraftOutput([logits[:, :, j] for j in range(steps)], [h[:, :, j + 1] for j in range(steps)])
