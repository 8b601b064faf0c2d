"""Run by tests/test_target_head.py under torch.distributed.run: each rank holds its rows
of one shared random head and scores its own (differently sized) batch of hidden states
with the sharded head; saves (lse, argmax) per rank."""

import sys

import torch
import torch.distributed as dist

from specft.train.target_head import TargetHead, row_range

VOCAB, HIDDEN = 1001, 16


def shared_head() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    head = torch.randn(VOCAB, HIDDEN, generator=g)
    head[100] *= 10  # a dominant row, duplicated into the last shard: argmax ties
    head[900] = head[100]
    return head


def rank_hidden(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1 + rank)
    hidden = torch.randn(rank + 2, 5, HIDDEN, generator=g)
    hidden[:, :2] += shared_head()[100] / 10  # these positions tie between rows 100 and 900
    return hidden


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    head = shared_head()
    start, stop = row_range(VOCAB, rank, world)
    sharded = TargetHead(head[start:stop].bfloat16(), start, VOCAB, head[:4], world)
    lse, argmax = sharded.full_vocab_stats(rank_hidden(rank), chunk=128)
    torch.save({"lse": lse, "argmax": argmax, "rows": stop - start}, f"{out}.{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
