"""The frozen target head split by vocabulary rows over ranks (trainer.target_head=sharded)
gives each rank the statistics a whole head gives."""


import pytest
import torch

from specft.train.target_head import TargetHead, row_range

from helpers import run_ranks


@pytest.mark.parametrize("vocab,world", [(1001, 3), (8, 8), (151936, 8), (5, 2)])
def test_row_ranges_cover_the_vocabulary_once(vocab, world):
    ranges = [row_range(vocab, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == vocab
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_three_ranks_with_a_sharded_head_match_the_whole_head(tmp_path):
    """Three ranks, uneven row shards (334/333/334 of 1001) and uneven batches (2, 3, 4
    sequences): each rank's logsumexp within 1e-5 of the whole head's, argmax equal, ties
    between a row in the first shard and its copy in the last resolved to the lower id."""
    from head_shard_worker import VOCAB, rank_hidden, shared_head

    out = tmp_path / "stats"
    run_ranks("head_shard_worker.py", 3, str(out))
    head = shared_head().bfloat16()
    whole = TargetHead(head, 0, VOCAB, head[:4])
    ties = 0
    for rank in range(3):
        got = torch.load(f"{out}.{rank}")
        assert got["rows"] == row_range(VOCAB, rank, 3)[1] - row_range(VOCAB, rank, 3)[0]
        lse, argmax = whole.full_vocab_stats(rank_hidden(rank), chunk=VOCAB)
        assert got["argmax"].shape == argmax.shape == rank_hidden(rank).shape[:-1]
        assert torch.equal(got["argmax"], argmax)
        torch.testing.assert_close(got["lse"], lse, rtol=1e-5, atol=1e-5)
        ties += int((argmax == 100).sum())
    assert ties >= 6 and not any((torch.load(f"{out}.{r}")["argmax"] == 900).any() for r in range(3))


def test_unknown_head_placement_is_one_config_error():
    from specft.common.errors import ConfigError

    from helpers import root_cfg

    with pytest.raises(ConfigError, match="trainer.target_head: 'split' is not allowed; allowed: replicated, sharded"):
        root_cfg("trainer.target_head=split")
