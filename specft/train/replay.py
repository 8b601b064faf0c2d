"""Replayed speculative decoding: what `specft eval` would count on a validation sample.

When a sample's answer is the target's own greedy output (regenerated data), decoding
that prompt with the target reproduces the answer token for token, and a round that
starts at position p is exactly the training-time test at p: draft step j reads the
target's features up to p and the draft's own previous steps, and is checked against
the target's next token at p + j + 1. So walking each answer round by round (accept the
leading hits, add the target's bonus token, jump ahead) gives the rounds, proposals and
acceptances greedy decoding would count, without running the target. On the dataset's
own answers it is only an estimate: the target would have said something else.

The independence product over per-step accuracies (``acceptance_length`` in
objective.py) ignores that a step is only reached when every earlier one hit, and reads
every position instead of the positions rounds start at; it runs high.
"""

from __future__ import annotations

import torch

from specft.decoding.engine import RoundCounts


def answer_spans(predicts: torch.Tensor) -> list[tuple[int, int]]:
    """(first, last + 1) of each run of positions whose next token is an assistant
    token: one decoding episode per assistant turn."""
    flags = predicts.bool().tolist()
    spans, start = [], None
    for p, on in enumerate(flags + [False]):
        if on and start is None:
            start = p
        elif not on and start is not None:
            spans.append((start, p))
            start = None
    return spans


def replay_sample(hits: torch.Tensor, predicts: torch.Tensor, k: int, max_new_tokens: int) -> RoundCounts:
    """``hits[j, p]``: draft step j at position p predicted the target's token at p+j+2
    (an assistant token). The prefill emits each turn's first token; every round proposes
    k and emits the leading hits plus one, until the turn ends or max_new_tokens are out."""
    counts = RoundCounts()
    h = hits[:k].bool()
    for start, end in answer_spans(predicts):
        length = min(end - start, max_new_tokens)  # tokens the decoder emits for this turn
        p, emitted = start, 1
        while emitted < length:
            lead = 0
            while lead < k and bool(h[lead, p]):
                lead += 1
            counts.rounds += 1
            counts.proposed += k
            counts.accepted += lead
            p += lead + 1
            emitted += lead + 1
    return counts


def step_hits(hit_rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """Stack step j's [B, T - j - 1] hit masks into [S, B, T] (False past each step's end)."""
    b = hit_rows[0].shape[0] if hit_rows else 0
    out = torch.zeros((len(hit_rows), b, length), dtype=torch.bool)
    for j, rows in enumerate(hit_rows):
        out[j, :, : rows.shape[1]] = rows.bool()
    return out
