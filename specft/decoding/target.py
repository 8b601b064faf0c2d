"""The target side of speculative decoding: a Hugging Face causal LM with a KV cache
whose rows may hold different numbers of valid tokens.

Every forward appends the same number of columns to every row; after verification each
row marks which of them it keeps. Rejected columns stay in the cache as holes, masked out
by the 2D attention mask, and RoPE positions count only kept tokens, so each row computes
what it would alone. Columns rejected by every row are cropped from the end at once. When
the next forward would not fit in the buffers and holes would make room, each row's kept
columns are moved together first (keys carry their RoPE positions, so attention reads the
same values): at batch 16 the holes would otherwise grow the cache by half again and
again, for columns no row reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specft.decoding.kv_cache import InPlaceCache


@dataclass
class TargetStep:
    logits: torch.Tensor  # [B, m, V]
    aux: torch.Tensor | None  # [B, m, 3H]: outputs of the draft's aux layers
    final: torch.Tensor  # [B, m, H]: post-norm final hidden (lm_head input)


class Engine:
    def __init__(self, model, aux_layer_ids: list[int] | None):
        self.model = model
        self.aux_layer_ids = aux_layer_ids or []
        self.cache: InPlaceCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L] long, 1 = valid
        self.next_pos: torch.Tensor | None = None  # [B] RoPE position of the next token

    def reset(self, batch: int, device, room: int = 256) -> None:
        """``room``: decode columns to allocate beyond the prompt (the cache grows past it)."""
        self.cache = InPlaceCache(room)
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.pending = torch.zeros(batch, 0, dtype=torch.long, device=device)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                last_logits_only: bool = False) -> TargetStep:
        """Run ``tokens`` [B, m]; ``valid`` [B, m] marks real tokens (left padding of
        prompts is 0). Columns stay pending (visible to later forwards) until ``commit``.
        ``last_logits_only``: logits [B, 1, V] of the last column (a prefill needs no more;
        the head over every prompt position is most of a prefill's work)."""
        valid = torch.ones_like(tokens) if valid is None else valid.long()
        if not self.pending.shape[1] and self.cache.free_columns() < tokens.shape[1]:
            self._compact()
        start = self.next_pos + self.pending.sum(-1)
        positions = start[:, None] + (valid.cumsum(-1) - 1).clamp(min=0)
        self.pending = torch.cat([self.pending, valid], dim=1)
        attention = torch.cat([self.mask, self.pending], dim=1)
        out = self.model(input_ids=tokens, attention_mask=attention, position_ids=positions,
                         cache=self.cache, use_cache=True, logits_to_keep=1 if last_logits_only else 0,
                         output_hidden_states=True)
        hs = out.hidden_states  # [embeddings, layer 0, ..., layer N-1 (post-norm last)]
        aux = torch.cat([hs[i + 1] for i in self.aux_layer_ids], -1) if self.aux_layer_ids else None
        return TargetStep(out.logits, aux, hs[-1])

    def commit(self, keep: torch.Tensor) -> None:
        """Keep the first ``keep[b]`` valid pending columns of row b (in order); drop the
        rest."""
        valid, self.pending = self.pending, self.pending[:, :0]
        kept = (valid.cumsum(-1) <= keep[:, None]).long() * valid
        self.mask = torch.cat([self.mask, kept], dim=1)
        self.next_pos = self.next_pos + kept.sum(-1)
        trailing = 0
        while trailing < self.mask.shape[1] and not self.mask[:, -1 - trailing].any():
            trailing += 1
        if trailing:
            self.cache.crop(-trailing)  # a negative count removes that many from the end
            self.mask = self.mask[:, : self.mask.shape[1] - trailing]

    def _compact(self) -> None:
        """Right-align each row's kept columns in the first max-kept columns; the holes
        before them stay masked (a stable sort keeps the kept columns in order)."""
        n = int(self.mask.sum(-1).max()) if self.mask.numel() else 0
        if n >= self.mask.shape[1]:
            return  # no column every row could give up
        order = torch.sort(self.mask, dim=-1, stable=True)
        first = self.mask.shape[1] - n
        self.cache.gather_columns(order.indices[:, first:])
        self.mask = order.values[:, first:]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask, self.next_pos, self.pending = self.mask[rows], self.next_pos[rows], self.pending[rows]

    def kv_bytes(self) -> int:
        """Bytes the KV cache holds: its allocated buffers, room ahead included."""
        return self.cache.allocated_bytes()
