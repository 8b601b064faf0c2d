"""The decode loop: prefill, then rounds of draft k -> verify k+1 in one target forward
-> keep the accepted prefix plus one target token, per row."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specft.decoding.draft import ChainRunner
from specft.decoding.sampling import SamplingConfig, sample, verify_greedy, verify_sampling, warp
from specft.decoding.target import Engine
from specft.device import synchronize
from specft.target_model.loader import left_pad


@dataclass
class RoundCounts:
    """What acceptance is computed from: target forwards after prefill (rounds; row-rounds
    in a batch), draft tokens proposed and accepted. Decoding counts them; the trainer's
    replayed validation (train/replay.py) counts what decoding would."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    def add(self, other: RoundCounts) -> None:
        self.rounds += other.rounds
        self.proposed += other.proposed
        self.accepted += other.accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per target forward (accepted drafts + the target's own token)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass
class DecodeStats(RoundCounts):
    generated: int = 0
    prefill_tokens: int = 0  # prompt tokens (padding excluded)
    proposed_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    # Per prompt (the unit a confidence interval resamples): [rounds, proposed, accepted].
    per_prompt: list[list[int]] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    peak_kv_bytes: int = 0


@dataclass
class DecodeResult:
    tokens: list[list[int]]  # generated ids per prompt (EOS included when hit)
    stats: DecodeStats


@dataclass
class _State:
    """The live rows of a batch between rounds."""

    rows: torch.Tensor  # live row -> prompt index
    last: torch.Tensor  # [B] the next token, not yet in any cache
    d_hidden: torch.Tensor | None = None  # the draft's state at each row's last position
    d_logits: torch.Tensor | None = None


class SpecDecoder:
    """``draft`` None decodes with the target alone (one token per forward)."""

    def __init__(self, target_model, draft: ChainRunner | None, aux_layer_ids: list[int] | None,
                 eos_ids: set[int], pad_id: int = 0):
        self.target = Engine(target_model, aux_layer_ids if draft is not None else None)
        self.draft = draft
        self.eos_ids = set(eos_ids)
        self.pad_id = pad_id

    def _choose(self, logits: torch.Tensor, s: SamplingConfig, gen) -> torch.Tensor:
        return logits.argmax(-1) if s.greedy else sample(warp(logits, s), gen)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], k: int, max_new_tokens: int,
                 sampling: SamplingConfig | None = None, min_confidence: float = 0.0,
                 seed: int = 0) -> DecodeResult:
        s = sampling or SamplingConfig()
        k = k if self.draft is not None else 0
        device = next(self.target.model.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed)
        stats = DecodeStats(proposed_at=[0] * k, accepted_at=[0] * k, per_prompt=[[0, 0, 0] for _ in prompts])
        out: list[list[int]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        # Room for every new token plus one round's pending columns; the holes rejected
        # drafts leave are compacted by the target runner before the cache would grow.
        state = self._prefill(prompts, s, gen, device, room=max_new_tokens + k + 1)
        synchronize(device)
        stats.prefill_s = time.perf_counter() - t0
        stats.prefill_tokens = sum(len(p) for p in prompts)
        live = self._emit(out, state.rows, state.last[:, None], torch.ones_like(state.last), max_new_tokens)
        t0 = time.perf_counter()
        while live.any():
            if not live.all():
                self._drop_finished(state, live.nonzero().squeeze(1))
            emitted, count = self._round(state, k, s, min_confidence, gen, stats)
            live = self._emit(out, state.rows, emitted, count, max_new_tokens)
            stats.peak_kv_bytes = max(stats.peak_kv_bytes, self._kv_bytes())
        synchronize(device)
        stats.decode_s = time.perf_counter() - t0
        stats.generated = sum(len(o) for o in out)
        return DecodeResult(out, stats)

    def _prefill(self, prompts, s: SamplingConfig, gen, device, room: int = 256) -> _State:
        b = len(prompts)
        self.target.reset(b, device, room)
        ids, valid = left_pad(prompts, self.pad_id, device)
        step = self.target.forward(ids, valid, last_logits_only=True)
        self.target.commit(valid.sum(-1))
        last = self._choose(step.logits[:, -1], s, gen)  # x[T]: the next token, not yet in any cache
        state = _State(rows=torch.arange(b), last=last)
        if self.draft is not None:
            self.draft.reset(b, device)
            nxt = torch.cat([ids[:, 1:], last[:, None]], 1)  # position p pairs with x[p+1]
            state.d_hidden, state.d_logits = self.draft.extend(step.aux, step.final, ids, nxt, valid)
        return state

    def _drop_finished(self, state: _State, keep: torch.Tensor) -> None:
        state.rows, state.last = state.rows[keep], state.last[keep]
        self.target.select_rows(keep)
        if self.draft is not None:
            self.draft.select_rows(keep)
            # A parallel drafter runs its context positions with the next round's draft
            # forward, so it hands back no state of its own here (None).
            state.d_logits = state.d_logits[keep] if state.d_logits is not None else None
            state.d_hidden = state.d_hidden[keep] if state.d_hidden is not None else None

    def _round(self, state: _State, k: int, s: SamplingConfig, min_confidence: float, gen,
               stats: DecodeStats) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft k, verify k+1 in one target forward; returns each row's emitted tokens
        and how many of them count."""
        n, device = len(state.rows), state.last.device
        probs = None
        if k:
            prop = self.draft.propose(state.d_hidden, state.d_logits, k, s, min_confidence, gen)
            drafts, proposed, probs = prop.tokens, prop.proposed, prop.probs
        else:
            drafts = torch.zeros(n, 0, dtype=torch.long, device=device)
            proposed = torch.zeros(n, dtype=torch.long, device=device)
        fed = torch.cat([state.last[:, None], drafts], 1)
        step = self.target.forward(fed)
        if s.greedy:
            accepted, bonus = verify_greedy(drafts, step.logits, proposed)
        else:
            accepted, bonus = verify_sampling(drafts, probs, step.logits, proposed, s, gen)
        self.target.commit(accepted + 1)
        self._count(stats, proposed, accepted, state.rows)
        emitted = torch.cat([drafts, bonus[:, None]], 1)
        emitted[torch.arange(n), accepted] = bonus
        if self.draft is not None:
            # Kept positions: last, then the accepted drafts; each pairs with the token after it.
            keep_cols = torch.arange(fed.shape[1], device=device)[None] <= accepted[:, None]
            state.d_hidden, state.d_logits = self.draft.extend(step.aux, step.final, fed, emitted, keep_cols)
        state.last = bonus
        return emitted, accepted + 1

    def _kv_bytes(self) -> int:
        return self.target.kv_bytes() + (self.draft.kv_bytes() if self.draft is not None else 0)

    def _count(self, stats: DecodeStats, proposed, accepted, rows: torch.Tensor) -> None:
        stats.rounds += len(rows)
        stats.proposed += int(proposed.sum())
        stats.accepted += int(accepted.sum())
        for prompt, p, a in zip(rows.tolist(), proposed.tolist(), accepted.tolist()):
            counts = stats.per_prompt[prompt]
            counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + p, counts[2] + a
        for j in range(len(stats.proposed_at)):
            stats.proposed_at[j] += int((proposed > j).sum())
            stats.accepted_at[j] += int((accepted > j).sum())

    def _emit(self, out, rows, emitted, count, max_new_tokens: int) -> torch.Tensor:
        """Append each live row's first ``count`` tokens, stopping at EOS or the budget;
        returns which rows continue."""
        live = []
        for r, prompt_idx in enumerate(rows.tolist()):
            seq = out[prompt_idx]
            done = False
            for tok in emitted[r, : int(count[r])].tolist():
                seq.append(tok)
                if tok in self.eos_ids or len(seq) >= max_new_tokens:
                    done = True
                    break
            live.append(not done)
        return torch.tensor(live, dtype=torch.bool)
