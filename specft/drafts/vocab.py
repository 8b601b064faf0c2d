"""The draft vocabulary: the most frequent target tokens in the training data.

``d2t[i]`` is the offset from draft id i to its target id (target = i + d2t[i]) and
``t2d`` marks which target ids the draft can emit, as EAGLE-3 and vLLM store them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftVocab:
    draft_to_target: torch.Tensor  # long [Vd]: target id of each draft id, ascending
    d2t: torch.Tensor  # long [Vd]
    t2d: torch.Tensor  # bool [V]
    coverage: float  # share of loss-masked training tokens the draft vocab covers

    @property
    def size(self) -> int:
        return len(self.draft_to_target)


def register_vocab_buffers(module, draft_to_target: torch.Tensor, target_vocab_size: int) -> None:
    """draft_to_target, d2t and t2d as buffers, saved with the draft (EAGLE-3 / vLLM keys)."""
    ids = draft_to_target.long().clone()
    module.register_buffer("draft_to_target", ids)
    module.register_buffer("d2t", ids - torch.arange(len(ids)))
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    module.register_buffer("t2d", t2d)


def build_draft_vocab(counts: torch.Tensor, size: int, fill_unseen: bool = False,
                      prior: torch.Tensor | None = None) -> DraftVocab:
    """Top-``size`` tokens by count (ties: lower id first). When the data has fewer
    distinct tokens than ``size``, the free slots go to unseen tokens by ``prior`` (highest
    first: e.g. the target's own next-token probabilities, train/vocab_prior.py), or in id
    order with ``fill_unseen``; with neither, the vocab shrinks to the tokens seen (a head
    row for a token never seen in training only learns to say no)."""
    vocab = counts.numel()
    seen = int((counts > 0).sum())
    fill = fill_unseen or prior is not None
    size = min(size, vocab if fill or seen == 0 else seen)
    ids = torch.arange(vocab)
    # Stable sort on -count keeps ascending ids among equal counts.
    order = torch.sort(-counts.long(), stable=True).indices
    if prior is not None:  # unseen tokens after the seen ones, most probable first
        unseen = order[seen:]
        order = torch.cat([order[:seen], unseen[torch.sort(-prior[unseen].double(), stable=True).indices]])
    selected = torch.sort(ids[order[:size]]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[selected] = True
    return DraftVocab(selected, selected - torch.arange(size), t2d, coverage(t2d, counts))


def coverage(t2d: torch.Tensor, counts: torch.Tensor) -> float:
    """Share of the counted tokens a draft vocabulary (its t2d mask) can emit."""
    total = counts.sum().item()
    return counts[t2d].sum().item() / total if total else 0.0
