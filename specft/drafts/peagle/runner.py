"""Parallel drafting with a KV cache: a round's k tokens from one draft forward.

The context positions a round adds (the verified tokens, each paired with the token
after it, as in chain drafting) wait until the next round's proposal; that proposal runs
them together with k-1 mask slots in one forward. The last context position's output is
the first drafted token, mask slot i's the (i+1)-th. Only the context positions' keys and
values stay in the cache; the mask slots' are dropped with the round, as vLLM overwrites
them with the next round's context.
"""

from __future__ import annotations

import torch

from specft.decoding.draft import ChainRunner, DraftPicks, Proposal, last_valid
from specft.decoding.sampling import SamplingConfig


class ParallelRunner(ChainRunner):
    def reset(self, batch: int, device) -> None:
        super().reset(batch, device)
        self.pending = None  # (embeddings, hidden inputs, positions, valid) of context columns not yet run

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        if self.pending is not None:
            self.pending = tuple(t[rows] for t in self.pending)

    @torch.no_grad()
    def extend(self, aux, final, tokens, next_tokens, valid):
        """Queue the new context positions for the next proposal's forward; the draft has
        no state to hand back until then."""
        valid = valid.bool()
        emb, start, positions = self.context_columns(aux, final, next_tokens, valid)
        self.pending = (emb, start, positions, valid)
        return None, None

    @torch.no_grad()
    def propose(self, hidden, logits, k: int, s: SamplingConfig, min_confidence: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        emb, start, positions, valid = self.pending
        b, m = valid.shape
        last = last_valid(valid)
        mask_emb, mask_hidden = self.draft.mask_inputs(b, k - 1)
        mask_positions = positions[torch.arange(b), last][:, None] + torch.arange(1, k, device=positions.device)
        hidden, fresh = self._run(torch.cat([emb, mask_emb], 1), torch.cat([start, mask_hidden], 1),
                                  torch.cat([positions, mask_positions], 1),
                                  torch.cat([valid, torch.ones(b, k - 1, dtype=torch.bool, device=valid.device)], 1))
        self.commit([(kk[:, :, :m], vv[:, :, :m]) for kk, vv in fresh], valid)
        self.pending = None
        outputs = torch.cat([hidden[torch.arange(b), last][:, None], hidden[:, m:]], 1)
        logits = self._logits(outputs)
        picks = DraftPicks(self.draft, b, k, s, min_confidence, generator, outputs.device)
        for j in range(k):
            if not picks.add(j, logits[:, j]):
                break
        return picks.proposal()
