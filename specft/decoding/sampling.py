"""Token choice and verification.

Greedy verification accepts a drafted token while it equals the target's argmax.
Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) accepts drafted token x,
drawn from the draft's distribution q, with probability min(1, p(x) / q(x)) and on a
rejection draws from norm(max(p - q, 0)); every emitted token is then distributed exactly
as the target's p. Both p and q are first warped the same way (temperature, top-k,
top-p), so the output follows the warped target distribution, as plain sampling would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: torch.Tensor, s: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (over the last dim)."""
    logits = logits.float() / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= s.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1])


def verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor,
                  proposed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, k] (target ids), target_logits [B, k+1, V], proposed [B] (how many of
    the k drafts each row really proposed). Returns (accepted count [B], next token [B])."""
    choice = target_logits.argmax(-1)  # [B, k+1]
    k = drafts.shape[1]
    match = (drafts == choice[:, :k]) & (torch.arange(k, device=drafts.device) < proposed[:, None])
    accepted = match.long().cumprod(-1).sum(-1)
    return accepted, choice.gather(1, accepted[:, None]).squeeze(1)


def verify_sampling(drafts: torch.Tensor, draft_probs: torch.Tensor, target_logits: torch.Tensor,
                    proposed: torch.Tensor, s: SamplingConfig,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_probs [B, k, V]: the (warped) distribution each draft was drawn from, over the
    target vocabulary. Same returns as verify_greedy."""
    b, k = drafts.shape
    p = warp(target_logits, s)  # [B, k+1, V]
    if k:
        p_x = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
        q_x = draft_probs.gather(-1, drafts[..., None]).squeeze(-1).clamp(min=1e-30)
        u = torch.rand(b, k, generator=generator, device=drafts.device)
        ok = (u < (p_x / q_x).clamp(max=1.0)) & (torch.arange(k, device=drafts.device) < proposed[:, None])
        accepted = ok.long().cumprod(-1).sum(-1)
    else:
        accepted = torch.zeros(b, dtype=torch.long, device=drafts.device)
    rows = torch.arange(b, device=drafts.device)
    final = p[rows, accepted]  # [B, V]
    # A row that rejected draft j draws from the residual at j; a row whose drafts were
    # all accepted (or that proposed fewer) draws from p itself.
    rejected = accepted < proposed
    if rejected.any() and k:
        q_at = draft_probs[rows, accepted.clamp(max=k - 1)]
        residual = (final - q_at).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), final)
        final = torch.where(rejected[:, None], residual, final)
    return accepted, sample(final, generator)
