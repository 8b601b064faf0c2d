"""Block drafting with a KV cache: a round's k tokens from one draft forward.

Each layer's cache holds the context keys and values of the fused target features (one
entry per context position, computed from the features alone). A proposal runs one block,
the token after the context then k mask tokens, attending to the valid cache entries and
to the whole block; the block's own keys are dropped with the round.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specft.decoding.draft import DraftPicks, Proposal, last_valid
from specft.decoding.sampling import SamplingConfig


class BlockRunner:
    def __init__(self, draft):
        self.draft = draft
        self.attns = [layer.self_attn for layer in draft.layers]

    def reset(self, batch: int, device) -> None:
        self.keys = [None] * len(self.attns)
        self.values = [None] * len(self.attns)
        self.mask = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.bonus = torch.zeros(batch, dtype=torch.long, device=device)  # the token after the context

    def select_rows(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.mask, self.next_pos, self.bonus = self.mask[rows], self.next_pos[rows], self.bonus[rows]

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values] if t is not None)

    @torch.no_grad()
    def extend(self, aux, final, tokens, next_tokens, valid):
        """Add the ``valid`` columns' target features as context; remember each row's token
        after its last context position (the next block's first token)."""
        valid = valid.bool()
        positions = self.next_pos[:, None] + (valid.long().cumsum(-1) - 1).clamp(min=0)
        ctx = self.draft.context(aux)
        for i, attn in enumerate(self.attns):
            k, v = attn.context_kv(ctx, positions)
            self.keys[i] = k if self.keys[i] is None else torch.cat([self.keys[i], k], 2)
            self.values[i] = v if self.values[i] is None else torch.cat([self.values[i], v], 2)
        self.mask = torch.cat([self.mask, valid], 1)
        self.next_pos = self.next_pos + valid.sum(-1)
        self.bonus = next_tokens[torch.arange(valid.shape[0]), last_valid(valid)]
        return None, None

    @torch.no_grad()
    def propose(self, hidden, logits, k: int, s: SamplingConfig, min_confidence: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        b = self.bonus.shape[0]
        h = self.draft.block_embeddings(self.bonus, k)  # [B, k+1, H]
        positions = self.next_pos[:, None] + torch.arange(k + 1, device=h.device)
        visible = torch.cat([self.mask, torch.ones(b, k + 1, dtype=torch.bool, device=h.device)], 1)[:, None, None]

        def attend(i, x):
            attn = self.attns[i]
            q, kb, vb = attn.qkv(x, positions)
            out = F.scaled_dot_product_attention(q, torch.cat([self.keys[i], kb], 2),
                                                 torch.cat([self.values[i], vb], 2),
                                                 attn_mask=visible, scale=1.0 / math.sqrt(attn.c.head_dim))
            return attn.out(out)

        for i, layer in enumerate(self.draft.layers):
            h = layer.step(h, lambda x, i=i: attend(i, x))
        logits = self.draft.logits(h[:, 1:])
        picks = DraftPicks(self.draft, b, k, s, min_confidence, generator, h.device)
        for j in range(k):
            if not picks.add(j, logits[:, j]):
                break
        return picks.proposal()
