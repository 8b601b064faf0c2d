"""The training-time-test objective: draft outputs for k steps against the target's
distribution, recomputed from the cached final hidden state with the target's lm_head."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specft.train.losses import LossInputs
from specft.train.target_head import TargetHead


@dataclass
class TargetView:
    """What the target says at every position, computed once per batch (no grad)."""

    probs: torch.Tensor  # [B, T, Vd] restricted to the draft vocab, renormalised
    argmax: torch.Tensor  # [B, T] over the full vocab
    predicts_assistant: torch.Tensor  # [B, T] float: position t predicts an assistant token
    in_draft_vocab: torch.Tensor  # [B, T] float: the target's argmax is in the draft vocab
    probs_full: torch.Tensor | None = None  # [B, T, Vd] full-vocab probabilities of draft ids
    hidden: torch.Tensor | None = None  # [B, T, H] the target's final hidden state


@torch.no_grad()
def target_view(batch: dict, head: TargetHead, t2d: torch.Tensor, vocab_chunk: int = 65536) -> TargetView:
    """A collective when the head is sharded (see specft.train.target_head)."""
    hidden = batch["final_hidden"].float()
    on_draft = head.draft_logits(hidden)
    lse, argmax = head.full_vocab_stats(hidden, vocab_chunk)
    # The target's output at position t predicts token t+1: train where that is an
    # assistant token.
    predicts = torch.nn.functional.pad(batch["loss_mask"][:, 1:], (0, 1))
    full = torch.exp(on_draft - lse)
    return TargetView(torch.softmax(on_draft, dim=-1), argmax, predicts, t2d[argmax].float(),
                      full, batch["final_hidden"])


@dataclass
class StepResult:
    loss: torch.Tensor  # weighted sum over steps (differentiable)
    step_losses: list[float] = field(default_factory=list)
    step_acc: list[float] = field(default_factory=list)  # draft argmax == target argmax
    step_accept: list[float] = field(default_factory=list)  # E[accept] = sum_x min(p, q)
    step_tokens: list[int] = field(default_factory=list)
    # For replayed decoding (train/replay.py): step j's hits [B, T - j - 1] (draft argmax
    # == target argmax, on positions predicting an assistant token) and that mask [B, T].
    step_hits: list[torch.Tensor] = field(default_factory=list)
    predicts: torch.Tensor | None = None


def acceptance_length(step_acc: list[float]) -> float:
    """Simulated mean acceptance length 1 + sum_k prod_{j<=k} acc_j of chain drafting."""
    total, run = 1.0, 1.0
    for a in step_acc:
        run *= a
        total += run
    return total


def ttt_objective(draft_logits: list[torch.Tensor], view: TargetView, draft_to_target: torch.Tensor,
                  loss_fn, step_weights: float | list[float],
                  draft_hidden: list[torch.Tensor] | None = None, keep_hits: bool = True,
                  on_policy: bool = False) -> StepResult:
    """Step j's outputs at position p are scored against the target at p+j+1. Positions
    whose target argmax is outside the draft vocabulary carry no loss (as EAGLE-3), but
    count as misses in acc_j. ``step_weights``: one weight per step, or a decay d giving
    step j the weight d ** j. ``keep_hits``: keep each step's hit mask (replayed validation
    needs them; training steps do not).

    ``on_policy`` (loss.on_policy): step j's loss at position p counts only when the
    draft's proposals of steps 0..j-1 from p each equal the target's argmax, i.e. where a
    round of greedy decoding that starts at p reaches step j; elsewhere the round has
    ended and what the draft would say there is never used. The step's loss stays a mean
    over all its positions (unreached ones add 0), so a step reached rarely weighs little."""
    if not isinstance(step_weights, (list, tuple)):
        step_weights = [step_weights**j for j in range(len(draft_logits))]
    t = view.argmax.shape[1]
    res = StepResult(draft_logits[0].new_zeros(()), predicts=view.predicts_assistant)
    reached = None  # [B, n] on_policy: steps 0..j-1 all verified from position p
    for j, logits in enumerate(draft_logits):
        n = t - j - 1
        if n <= 0:  # too short for this step: record nothing learned, keep lists aligned
            res.step_losses.append(0.0)
            res.step_acc.append(0.0)
            res.step_accept.append(0.0)
            res.step_tokens.append(0)
            if keep_hits:
                res.step_hits.append(torch.zeros((view.argmax.shape[0], 0), dtype=torch.bool))
            continue
        logits = logits[:, :n].float()  # losses in fp32 even when the draft runs in bf16
        valid = view.predicts_assistant[:, j + 1:]
        weight = valid * view.in_draft_vocab[:, j + 1:]
        inputs = LossInputs(logits, view.probs[:, j + 1:],
                            draft_hidden[j][:, :n].float() if draft_hidden is not None else None,
                            view.hidden[:, j + 1:] if view.hidden is not None else None)
        counted = weight if reached is None else weight * reached[:, :n]
        step_loss = (loss_fn(inputs) * counted).sum() / weight.sum().clamp(min=1.0)
        res.loss = res.loss + step_weights[j] * step_loss
        with torch.no_grad():
            denom = valid.sum().clamp(min=1.0)
            hit = (draft_to_target[logits.argmax(-1)] == view.argmax[:, j + 1:]).float()
            if on_policy:
                reached = hit if reached is None else reached[:, :n] * hit
            if keep_hits:
                res.step_hits.append((hit * valid).bool())
            res.step_losses.append(step_loss.item())
            res.step_acc.append(((hit * valid).sum() / denom).item())
            if view.probs_full is not None:
                q = torch.softmax(logits, dim=-1)
                accept = torch.minimum(view.probs_full[:, j + 1:], q).sum(-1)
                res.step_accept.append(((accept * valid).sum() / denom).item())
            res.step_tokens.append(int(valid.sum().item()))
    return res
