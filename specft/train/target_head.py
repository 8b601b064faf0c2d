"""The frozen target lm_head in stage 2: the target's full-vocabulary log-normalizer and
argmax at every cached position, and its logits on the draft vocabulary.

``trainer.target_head=replicated`` keeps the whole head on every rank. ``sharded`` keeps
1/world of its rows per rank (Megatron's vocab-parallel split): a 151936 x 4096 head
costs 1.2 GB per rank in bf16 replicated, 0.16 GB over 8 ranks. Ranks train on different
batches, so a sharded step all-gathers the batch's final hidden states (tokens x H, small
next to the head), each rank scores every rank's tokens on its rows, and the partial
log-sum-exps and maxima are all-reduced. The draft-vocabulary rows (what the loss
compares against) stay on every rank either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

HEAD_PLACEMENTS = ("replicated", "sharded")


def row_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [start, stop) of a ``vocab``-row head held by ``rank`` of ``world``: contiguous,
    sizes differing by at most one."""
    base, extra = divmod(vocab, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def chunked_stats(hidden: torch.Tensor, rows: torch.Tensor, chunk: int, offset: int = 0):
    """(logsumexp [N, 1], max logit [N], argmax [N] + offset) of hidden @ rows.T, a chunk of
    rows at a time: a 152k-token head never materializes [N, V] logits, and the rows can
    stay in their stored dtype (each chunk is computed in the hidden's dtype)."""
    lse = best = where = None
    for start in range(0, rows.shape[0], chunk):
        logits = hidden @ rows[start: start + chunk].to(hidden.dtype).T
        part_lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        part_best, part_where = logits.max(dim=-1)
        if lse is None:
            lse, best, where = part_lse, part_best, part_where
            continue
        lse = torch.logaddexp(lse, part_lse)
        better = part_best > best  # ties keep the earlier index, as argmax does
        best, where = torch.where(better, part_best, best), torch.where(better, part_where + start, where)
    return lse, best, where + offset


@dataclass
class TargetHead:
    rows: torch.Tensor  # [stop - start, H]: this rank's rows (all of them when replicated)
    start: int  # the first row's vocabulary id
    vocab_size: int
    draft_rows: torch.Tensor  # [Vd, H]: the rows of the draft vocabulary, on every rank
    world: int = 1  # ranks the rows are spread over (1: replicated)

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.draft_rows.to(hidden.dtype).T

    def full_vocab_stats(self, hidden: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logsumexp [.., 1], argmax [..]) over the whole vocabulary. Sharded: a collective,
        every rank must call it the same number of times."""
        if not self.sharded:
            lse, _, where = chunked_stats(hidden, self.rows, chunk)
            return lse, where
        lead = hidden.shape[:-1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        everyone, counts = _gather_rows(flat, self.world)
        lse, best, where = chunked_stats(everyone, self.rows, chunk, self.start)
        lse, where = _combine_shards(lse, best, where, self.vocab_size)
        mine = slice(sum(counts[: dist.get_rank()]), sum(counts[: dist.get_rank() + 1]))
        return lse[mine].reshape(*lead, 1), where[mine].reshape(lead)


def _gather_rows(flat: torch.Tensor, world: int) -> tuple[torch.Tensor, list[int]]:
    """Every rank's [n_r, H] rows stacked in rank order; ranks' n_r may differ."""
    n = torch.tensor([flat.shape[0]], dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    counts = [int(s.item()) for s in sizes]
    padded = flat.new_zeros(max(counts), flat.shape[1])
    padded[: flat.shape[0]] = flat
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:c] for p, c in zip(parts, counts)]), counts


def _combine_shards(lse: torch.Tensor, best: torch.Tensor, where: torch.Tensor, vocab: int):
    """Whole-vocabulary logsumexp and argmax from each rank's over its own rows. Ties go to
    the lowest vocabulary id, as a replicated argmax does (shards are contiguous and in
    rank order)."""
    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    total = torch.exp(lse - top)
    dist.all_reduce(total)
    overall = best.clone()
    dist.all_reduce(overall, op=dist.ReduceOp.MAX)
    candidate = torch.where(best == overall, where, torch.full_like(where, vocab))
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN)
    return top + torch.log(total), candidate


def load_target_head(reader, placement: str, draft_rows: torch.Tensor, rank: int, world: int) -> TargetHead:
    """This rank's part of the cached target head (``reader``: a CacheReader), read from
    disk row range by row range: a sharded rank never holds the whole head."""
    vocab = reader.target_head_vocab()
    shards = world if placement == "sharded" else 1
    start, stop = row_range(vocab, rank if shards > 1 else 0, shards)
    rows = reader.target_head_rows(start, stop)
    return TargetHead(rows, start, vocab, draft_rows, shards)
