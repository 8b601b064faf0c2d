"""Alignment losses (registry) and their weighted mixtures.

Every loss maps one TTT step's ``LossInputs`` to a loss per position. ``target_probs`` is
the target's distribution restricted to the draft vocabulary and renormalised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specft.common.registry import Registry

LOSSES: Registry = Registry("loss")


@dataclass
class LossInputs:
    draft_logits: torch.Tensor  # [B, N, Vd]
    target_probs: torch.Tensor  # [B, N, Vd]
    draft_hidden: torch.Tensor | None = None  # [B, N, H] the draft layer's output
    target_hidden: torch.Tensor | None = None  # [B, N, H] the target's final hidden


@LOSSES.register("kl")
def kl_loss(x: LossInputs) -> torch.Tensor:
    """Soft cross-entropy -sum_x p(x) log q(x): the EAGLE-3 baseline (KL(p||q) up to the
    target's entropy, which has no gradient)."""
    return -(x.target_probs * torch.log_softmax(x.draft_logits, dim=-1)).sum(-1)


@LOSSES.register("lk")
def lk_loss(x: LossInputs) -> torch.Tensor:
    """-log sum_x min(p(x), q(x)): the negative log of the expected acceptance rate of
    speculative sampling, optimised directly."""
    q = torch.softmax(x.draft_logits, dim=-1)
    return -torch.log(torch.minimum(x.target_probs, q).sum(-1).clamp(min=1e-12))


@LOSSES.register("tv")
def tv_loss(x: LossInputs) -> torch.Tensor:
    """Total variation 0.5 * sum_x |p(x) - q(x)| = 1 - expected acceptance."""
    q = torch.softmax(x.draft_logits, dim=-1)
    return 0.5 * (x.target_probs - q).abs().sum(-1)


@LOSSES.register("ce")
def ce_loss(x: LossInputs) -> torch.Tensor:
    """Cross-entropy against the target's argmax (what greedy verification accepts)."""
    labels = x.target_probs.argmax(-1)
    return F.cross_entropy(x.draft_logits.flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)


@LOSSES.register("hidden")
def hidden_loss(x: LossInputs) -> torch.Tensor:
    """Smooth-L1 regression of the draft's hidden state onto the target's final hidden
    state at the position it predicts from (EAGLE's feature loss)."""
    if x.draft_hidden is None or x.target_hidden is None:
        raise ValueError("the hidden loss needs draft and target hidden states")
    return F.smooth_l1_loss(x.draft_hidden, x.target_hidden, reduction="none").mean(-1)


class MixtureLoss:
    """sum_i w_i * loss_i, from ``{name: weight}``; unknown names list the known ones."""

    def __init__(self, terms: dict[str, float], field: str = "loss.terms"):
        if not terms:
            raise ValueError("a loss mixture needs at least one term")
        self.terms = {LOSSES.get(name, field): float(w) for name, w in terms.items()}
        self.needs_hidden = "hidden" in terms

    def __call__(self, x: LossInputs) -> torch.Tensor:
        return sum(w * fn(x) for fn, w in self.terms.items())
