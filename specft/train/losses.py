"""Alignment losses (registry). Each maps draft logits over the draft vocabulary and the
target's logits over the full vocabulary to a loss per position."""

from __future__ import annotations

import torch

from specft.registry import Registry

LOSSES: Registry = Registry("loss")
# Signature of every loss: (draft_logits [..., Vd], target_probs [..., Vd]) -> loss [...],
# where target_probs is the target's distribution restricted to the draft vocabulary.


def restricted_target_probs(target_logits: torch.Tensor, draft_to_target: torch.Tensor) -> torch.Tensor:
    """The target distribution restricted to the draft vocabulary and renormalised."""
    return torch.softmax(target_logits.index_select(-1, draft_to_target), dim=-1)


@LOSSES.register("kl")
def kl_loss(draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Soft cross-entropy -sum_x p(x) log q(x) over the draft vocabulary: the EAGLE-3
    baseline (KL(p||q) up to the target's entropy, which has no gradient)."""
    return -(target_probs * torch.log_softmax(draft_logits, dim=-1)).sum(-1)
