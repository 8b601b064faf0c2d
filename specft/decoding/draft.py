"""The draft side: chain drafting with a KV cache, for the heads in specft.drafts.

The cache holds one entry per context position p, computed as the draft's first step
there (EAGLE-3: token x[p+1] with fc(target aux features at p); MTP: token x[p+1] with
the target's final hidden at p), exactly what the training unroll's step 0 attends to.
A round drafts k tokens from the last context position: step j feeds the token drafted
at step j-1 and the draft's own hidden state, at RoPE position p+j, attending to the
context entries and to this chain's earlier steps, as training-time test does for
EAGLE-3. The chain's entries are dropped after the round. (An MTP head is trained with a
separate causal sequence per step; drafting it as a chain, as serving engines do, is
exact for its first token and an approximation after that.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specft.decoding.sampling import SamplingConfig, sample, warp


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] target ids
    probs: torch.Tensor | None  # [B, k, V] warped draft distributions over the target vocab (sampling only)
    proposed: torch.Tensor  # [B] how many of the k tokens each row really proposes


def stop_unsure(logits: torch.Tensor, j: int, min_confidence: float, active: torch.Tensor,
                proposed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic draft length: a row whose draft top-1 probability at step j is below
    ``min_confidence`` proposes only its first j tokens. Returns (active, proposed)."""
    if min_confidence <= 0:
        return active, proposed
    confident = torch.softmax(logits.float(), -1).amax(-1) >= min_confidence
    proposed = torch.where(active & ~confident, torch.full_like(proposed, j), proposed)
    return active & confident, proposed


def last_valid(valid: torch.Tensor) -> torch.Tensor:
    m = valid.shape[1]
    return m - 1 - valid.long().flip(-1).argmax(-1)


class ChainRunner:
    """Chain drafting with a KV cache for any draft head that offers the training
    modules' own pieces: ``attention_modules()`` (each with qkv/out), ``start_hidden``,
    ``decode_step(emb, hidden, attend)`` (the layers' step around ``attend(i, x)``) and
    ``logits``. Decoding runs the very code training runs; only attention differs."""

    def __init__(self, draft):
        self.draft = draft
        self.attns = draft.attention_modules()

    def _step(self, emb, hidden, attend) -> torch.Tensor:
        return self.draft.decode_step(emb, hidden, attend)

    def _start_hidden(self, aux, final) -> torch.Tensor:
        return self.draft.start_hidden(aux, final)

    def _logits(self, hidden) -> torch.Tensor:
        return self.draft.logits(hidden)

    # --- cache ---------------------------------------------------------------------
    def reset(self, batch: int, device) -> None:
        n = len(self.attns)
        self.keys = [None] * n
        self.values = [None] * n
        self.mask = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.mask, self.next_pos = self.mask[rows], self.next_pos[rows]

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values] if t is not None)

    def _run(self, emb, hidden, positions, new_valid, chain_k=None, chain_v=None):
        """Run one step over m new columns. Keys visible to column c: valid cache
        entries, the chain's entries, and new columns <= c that are valid (a column
        always sees itself, so padding columns stay finite)."""
        b, m = new_valid.shape
        chain_len = len(chain_k[0]) if chain_k else 0
        causal = torch.ones(m, m, dtype=torch.bool, device=emb.device).tril()
        new_keys_ok = (new_valid[:, None, :] & causal) | torch.eye(m, dtype=torch.bool, device=emb.device)
        old = torch.cat([self.mask, torch.ones(b, chain_len, dtype=torch.bool, device=emb.device)], 1)
        visible = torch.cat([old[:, None, :].expand(b, m, -1), new_keys_ok], -1)[:, None]
        fresh = []

        def attend(i, x):
            attn = self.attns[i]
            q, k, v = attn.qkv(x, positions)
            ks = [t for t in (self.keys[i], *(chain_k[i] if chain_k else ())) if t is not None]
            vs = [t for t in (self.values[i], *(chain_v[i] if chain_v else ())) if t is not None]
            keys, vals = torch.cat([*ks, k], 2), torch.cat([*vs, v], 2)
            out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=visible,
                                                 scale=1.0 / math.sqrt(attn.c.head_dim))
            fresh.append((k, v))
            return attn.out(out)

        hidden = self._step(emb, hidden, attend)
        return hidden, fresh

    def context_columns(self, aux, final, next_tokens, valid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step-0 inputs of new context positions (features at p, token x[p+1]): the token
        embeddings, the hidden inputs and the RoPE positions of the ``valid`` columns."""
        positions = self.next_pos[:, None] + (valid.long().cumsum(-1) - 1).clamp(min=0)
        return self.draft.embed_tokens(next_tokens), self._start_hidden(aux, final), positions

    def commit(self, fresh: list, valid: torch.Tensor) -> None:
        """Keep the new context columns' keys and values (``fresh``, per attention module)."""
        for i, (k, v) in enumerate(fresh):
            self.keys[i] = k if self.keys[i] is None else torch.cat([self.keys[i], k], 2)
            self.values[i] = v if self.values[i] is None else torch.cat([self.values[i], v], 2)
        self.mask = torch.cat([self.mask, valid], 1)
        self.next_pos = self.next_pos + valid.sum(-1)

    @torch.no_grad()
    def extend(self, aux, final, tokens, next_tokens, valid) -> tuple[torch.Tensor, torch.Tensor]:
        """Add context positions (features at p, token x[p+1]) for the ``valid`` columns
        [B, m] (``tokens`` holds x[p], unused by feature-driven heads); returns the hidden
        state and logits at each row's last new position."""
        valid = valid.bool()
        emb, start, positions = self.context_columns(aux, final, next_tokens, valid)
        hidden, fresh = self._run(emb, start, positions, valid)
        self.commit(fresh, valid)
        last = hidden[torch.arange(hidden.shape[0]), last_valid(valid)]
        return last, self._logits(last)

    @torch.no_grad()
    def propose(self, hidden, logits, k: int, s: SamplingConfig, min_confidence: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        """Draft k tokens from each row's last context position, one step per token."""
        b = hidden.shape[0]
        picks = DraftPicks(self.draft, b, k, s, min_confidence, generator, hidden.device)
        chain_k = [[] for _ in self.attns]
        chain_v = [[] for _ in self.attns]
        base = self.next_pos - 1
        for j in range(k):
            if j:
                emb = self.draft.embed_tokens(picks.tokens[-1])[:, None]
                hidden, fresh = self._run(emb, hidden[:, None], (base + j)[:, None],
                                          torch.ones(b, 1, dtype=torch.bool, device=hidden.device),
                                          chain_k, chain_v)
                for i, (kk, vv) in enumerate(fresh):
                    chain_k[i].append(kk)
                    chain_v[i].append(vv)
                hidden = hidden[:, 0]
                logits = self._logits(hidden)
            if not picks.add(j, logits):
                break
        return picks.proposal()


class DraftPicks:
    """The tokens a round drafts, chosen position by position from the draft's logits
    over its own vocabulary (greedy or sampled, mapped to target ids), with dynamic draft
    length; chain and parallel drafters share it."""

    def __init__(self, draft, batch: int, k: int, s: SamplingConfig, min_confidence: float,
                 generator: torch.Generator | None, device):
        self.draft, self.s, self.min_confidence, self.generator = draft, s, min_confidence, generator
        self.tokens: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.proposed = torch.full((batch,), k, dtype=torch.long, device=device)
        self.active = torch.ones(batch, dtype=torch.bool, device=device)

    def add(self, j: int, logits: torch.Tensor) -> bool:
        """Choose position j's tokens; False when no row drafts further."""
        self.active, self.proposed = stop_unsure(logits, j, self.min_confidence, self.active, self.proposed)
        d2t = self.draft.draft_to_target
        if self.s.greedy:
            choice = logits.argmax(-1)
        else:
            q = warp(logits, self.s)
            choice = sample(q, self.generator)
            full = torch.zeros(q.shape[0], self.draft.t2d.numel(), dtype=q.dtype, device=q.device)
            self.probs.append(full.scatter(1, d2t.expand(q.shape[0], -1), q))
        self.tokens.append(d2t[choice])
        return not (self.min_confidence > 0 and not self.active.any())

    def proposal(self) -> Proposal:
        stacked = torch.stack(self.tokens, 1)
        return Proposal(stacked, torch.stack(self.probs, 1) if self.probs else None,
                        self.proposed.clamp(max=stacked.shape[1]))


class TargetAsDraft:
    """The target drafting for itself (an oracle): proposes the target's own greedy or
    sampled continuation. An upper bound for acceptance and a check of the engine: under
    greedy verification every proposal must be accepted."""

    def __init__(self, model):
        from specft.decoding.target import Engine

        self.runner = Engine(model, None)
        self.draft = None

    def reset(self, batch: int, device) -> None:
        self.runner.reset(batch, device)

    def select_rows(self, rows) -> None:
        self.runner.select_rows(rows)

    def kv_bytes(self) -> int:
        return self.runner.kv_bytes()

    @torch.no_grad()
    def extend(self, aux, final, tokens, next_tokens, valid):
        """Commit x[p] for the new positions, then feed x[n+1] (kept pending: it is the
        next round's first target column) to get the logits of x[n+2]."""
        valid = valid.long()
        self.runner.forward(tokens, valid)
        self.runner.commit(valid.sum(-1))
        nxt = next_tokens[torch.arange(valid.shape[0]), last_valid(valid.bool())]
        return None, self.runner.forward(nxt[:, None]).logits[:, -1]

    @torch.no_grad()
    def propose(self, hidden, logits, k: int, s: SamplingConfig, min_confidence: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        tokens, probs = [], []
        b = logits.shape[0]
        proposed = torch.full((b,), k, dtype=torch.long, device=logits.device)
        active = torch.ones(b, dtype=torch.bool, device=logits.device)
        for j in range(k):
            if j:
                logits = self.runner.forward(tokens[-1][:, None]).logits[:, -1]
            active, proposed = stop_unsure(logits, j, min_confidence, active, proposed)
            if s.greedy:
                tokens.append(logits.argmax(-1))
            else:
                q = warp(logits, s)
                probs.append(q)
                tokens.append(sample(q, generator))
        self.runner.commit(torch.zeros(b, dtype=torch.long, device=logits.device))  # drop x[n+1] and the chain
        return Proposal(torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None, proposed)
