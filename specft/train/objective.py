"""The training-time-test objective: draft logits for k steps against the target's
distribution, recomputed from the cached final hidden state with the target's lm_head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specft.train.losses import restricted_target_probs


@dataclass
class TargetView:
    """What the target says at every position, computed once per batch (no grad)."""

    probs: torch.Tensor  # [B, T, Vd] restricted to the draft vocab
    argmax: torch.Tensor  # [B, T] over the full vocab
    predicts_assistant: torch.Tensor  # [B, T] float: position t predicts an assistant token
    in_draft_vocab: torch.Tensor  # [B, T] float: the target's argmax is in the draft vocab


@torch.no_grad()
def target_view(batch: dict, lm_head: torch.Tensor, draft_to_target: torch.Tensor,
                t2d: torch.Tensor) -> TargetView:
    logits = batch["final_hidden"] @ lm_head.T
    argmax = logits.argmax(-1)
    mask = batch["loss_mask"]
    # The target's output at position t predicts token t+1: train where that is an
    # assistant token.
    predicts = torch.nn.functional.pad(mask[:, 1:], (0, 1))
    return TargetView(restricted_target_probs(logits, draft_to_target), argmax, predicts,
                      t2d[argmax].float())


@dataclass
class StepResult:
    loss: torch.Tensor  # weighted sum over steps (differentiable)
    step_losses: list[float]
    step_acc: list[float]
    step_tokens: list[int]


def ttt_objective(draft_logits: list[torch.Tensor], view: TargetView, draft_to_target: torch.Tensor,
                  loss_fn, step_weight_decay: float) -> StepResult:
    """Step j's logits at position p are scored against the target at p+j+1. Positions whose
    target argmax is outside the draft vocabulary carry no loss (as EAGLE-3), but count
    as misses in acc_j."""
    t = view.argmax.shape[1]
    total = draft_logits[0].new_zeros(())
    losses, accs, counts = [], [], []
    for j, logits in enumerate(draft_logits):
        n = t - j - 1
        if n <= 0:
            break
        logits = logits[:, :n]
        valid = view.predicts_assistant[:, j + 1:]
        weight = valid * view.in_draft_vocab[:, j + 1:]
        per_pos = loss_fn(logits, view.probs[:, j + 1:])
        step_loss = (per_pos * weight).sum() / weight.sum().clamp(min=1.0)
        total = total + (step_weight_decay ** j) * step_loss
        hit = (draft_to_target[logits.argmax(-1)] == view.argmax[:, j + 1:]).float()
        denom = valid.sum().clamp(min=1.0)
        losses.append(step_loss.item())
        accs.append(((hit * valid).sum() / denom).item())
        counts.append(int(valid.sum().item()))
    return StepResult(total, losses, accs, counts)
