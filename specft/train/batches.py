"""Deterministic batches: step s's samples are a pure function of (seed, s, rank), so a
resumed run sees exactly the data an uninterrupted one would, with no sampler state."""

from __future__ import annotations

import torch


class StepSampler:
    def __init__(self, num_samples: int, seed: int, micro_batch: int, grad_accum: int,
                 rank: int, world_size: int):
        self.n, self.seed = num_samples, seed
        self.micro, self.accum, self.rank, self.world = micro_batch, grad_accum, rank, world_size
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g)}
        return self._perms[epoch]

    def _sample_at(self, stream_pos: int) -> int:
        return int(self._perm(stream_pos // self.n)[stream_pos % self.n])

    def epoch_of_step(self, step: int) -> int:
        """The epoch step ``step`` starts in, the same on every rank: where answers change
        each epoch, a step reads the answers of this epoch for all its samples."""
        return step * self.global_batch // self.n

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's micro-batches (sample indices) for optimizer step ``step``."""
        base = step * self.global_batch
        out = []
        for m in range(self.accum):
            start = base + (m * self.world + self.rank) * self.micro
            out.append([self._sample_at(start + i) for i in range(self.micro)])
        return out


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad a list of cache samples to one batch."""
    length = max(len(it["input_ids"]) for it in items)
    batch = {}
    for key in ("input_ids", "loss_mask", "aux_hidden", "final_hidden"):
        first = items[0][key]
        out = torch.zeros((len(items), length, *first.shape[1:]), dtype=first.dtype)
        for row, it in enumerate(items):
            out[row, : len(it[key])] = it[key]
        batch[key] = out
    return batch
