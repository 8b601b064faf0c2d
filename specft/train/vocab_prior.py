"""A frequency prior over the whole target vocabulary, from the target itself: its mean
next-token probabilities over a seeded sample of cached positions (prompts and answers).

The draft vocabulary takes the tokens the training answers hold first; the prior ranks
the rest, so slots beyond the seen tokens go to what the target is likely to say on such
text rather than to low token ids (FR-Spec, arXiv 2502.14856, ranks by corpus frequency
for the same reason).
"""

from __future__ import annotations

import torch

from specft.train.target_head import chunked_stats

POSITION_BLOCK = 256  # positions scored at once: [256, V] float32 logits per vocab chunk


@torch.no_grad()
def target_prior(reader, max_positions: int = 2048, seed: int = 0, vocab_chunk: int = 65536) -> torch.Tensor:
    """Mean softmax of the target's logits ([V], float64, sums to 1) over up to
    ``max_positions`` cached positions from samples in a seeded order."""
    order = torch.randperm(len(reader), generator=torch.Generator().manual_seed(seed + 104729)).tolist()
    picked, n = [], 0
    for i in order:
        hidden = reader[i]["final_hidden"]
        picked.append(hidden[: max_positions - n])
        n += picked[-1].shape[0]
        if n >= max_positions:
            break
    hidden = torch.cat(picked).float()
    rows = reader.target_head_rows(0, reader.target_head_vocab())
    prior = torch.zeros(rows.shape[0], dtype=torch.float64)
    for a in range(0, hidden.shape[0], POSITION_BLOCK):
        h = hidden[a: a + POSITION_BLOCK]
        lse, _, _ = chunked_stats(h, rows, vocab_chunk)
        for start in range(0, rows.shape[0], vocab_chunk):
            logits = h @ rows[start: start + vocab_chunk].float().T
            prior[start: start + vocab_chunk] += torch.exp(logits - lse).sum(0).double()
    return prior / hidden.shape[0]
