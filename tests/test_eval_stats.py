"""Acceptance confidence intervals: the bootstrap over prompts against a normal-theory
oracle, paired differences that see a real gap and none where there is none."""

import numpy as np
import pytest

from specft.eval.report import verdict
from specft.eval.stats import confidence, paired_difference


def _prompts(rates, proposed=30, rounds=10):
    """[rounds, proposed, accepted] per prompt with the given per-prompt acceptance."""
    return [[rounds, proposed, round(r * proposed)] for r in rates]


def test_rate_interval_matches_the_normal_approximation():
    # Equal proposals per prompt: the ratio of sums is the mean of per-prompt rates, whose
    # 95% interval is mean +- 1.96 s / sqrt(n) for many prompts.
    rates = np.random.default_rng(0).beta(2, 3, size=400)
    per_prompt = _prompts(rates)
    observed = np.array([a / p for _, p, a in per_prompt])
    half = 1.96 * observed.std(ddof=1) / np.sqrt(len(observed))
    lo, hi = confidence(per_prompt, seed=0)["acceptance_rate_ci"]
    assert lo < observed.mean() < hi
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1)


def test_intervals_are_seeded_and_contain_the_estimate():
    per_prompt = _prompts(np.random.default_rng(1).uniform(0, 1, size=32))
    a, b = confidence(per_prompt, seed=5), confidence(per_prompt, seed=5)
    assert a == b
    lo, hi = a["acceptance_length_ci"]
    estimate = sum(r + acc for r, _, acc in per_prompt) / sum(r for r, _, _ in per_prompt)
    assert lo <= estimate <= hi and hi > lo


def test_paired_difference_sees_a_gap_the_unpaired_intervals_hide():
    rng = np.random.default_rng(2)
    difficulty = rng.uniform(0.05, 0.9, size=24)  # prompts differ far more than the drafts do
    a = _prompts(difficulty)
    b = _prompts(np.clip(difficulty + 0.05, 0, 1))
    ci_a, ci_b = confidence(a, 0)["acceptance_rate_ci"], confidence(b, 0)["acceptance_rate_ci"]
    assert ci_a[1] > ci_b[0]  # the separate intervals overlap
    diff = paired_difference(a, b, seed=0)
    assert diff["distinguishable"] and diff["rate_difference_ci"][0] > 0
    assert diff["rate_difference"] == pytest.approx(0.05, abs=0.01)
    assert verdict({**diff, "a": "base", "b": "ours"}) == "ours higher"


def test_same_draft_twice_is_no_difference():
    a = _prompts(np.random.default_rng(3).uniform(0, 1, size=16))
    diff = paired_difference(a, a, seed=0)
    assert diff["rate_difference"] == 0 and not diff["distinguishable"]
    assert verdict({**diff, "a": "x", "b": "y"}).startswith("no difference")


def test_one_prompt_gives_a_point_interval():
    assert confidence([[4, 12, 6]], seed=0)["acceptance_rate_ci"] == [0.5, 0.5]
