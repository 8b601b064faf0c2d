"""Confidence intervals for acceptance: scipy's bootstrap over prompts.

Prompts are the unit: tokens of one answer are not independent (a draft that fits a
prompt is accepted all through it), so resampling tokens would give intervals far too
narrow. Each statistic is a ratio of sums over the resampled prompts, as the point
estimate is over all prompts. Two drafts decoded on the same prompts are compared on
the same resampled prompts (a paired bootstrap), which cancels the prompts' own
difficulty from their difference.
"""

from __future__ import annotations

import warnings

import numpy as np
from scipy import stats

RESAMPLES = 2000
LEVEL = 0.95


def _ratio(num, den, axis=-1):
    num, den = np.sum(num, axis=axis), np.sum(den, axis=axis)
    return np.divide(num, den, out=np.zeros(np.shape(num)), where=den > 0)


def rate(rounds, proposed, accepted, axis=-1):
    """accepted / proposed draft tokens."""
    return _ratio(accepted, proposed, axis)


def length(rounds, proposed, accepted, axis=-1):
    """(accepted + rounds) / rounds: tokens emitted per target forward."""
    return _ratio(np.add(accepted, rounds), rounds, axis)


def _columns(per_prompt: list[list[int]]) -> tuple[np.ndarray, ...]:
    """[rounds, proposed, accepted] per prompt -> three columns."""
    a = np.asarray(per_prompt, dtype=np.float64).reshape(-1, 3)
    return a[:, 0], a[:, 1], a[:, 2]


def _interval(samples: tuple, statistic, seed: int) -> list[float]:
    if len(samples[0]) < 2:  # one prompt: nothing to resample
        value = float(statistic(*samples))
        return [value, value]
    with warnings.catch_warnings():  # identical resamples (a degenerate case) warn, and give a point
        warnings.simplefilter("ignore")
        res = stats.bootstrap(samples, statistic, paired=True, vectorized=True, n_resamples=RESAMPLES,
                              confidence_level=LEVEL, method="percentile", rng=np.random.default_rng(seed))
    lo, hi = res.confidence_interval
    return [float(lo), float(hi)]


def ratio_interval(numerators: list[int], denominators: list[int], seed: int) -> list[float]:
    """95% CI of sum(numerators) / sum(denominators), resampling the units (prompts,
    conversations) they were counted on; e.g. `specft distance`'s top-1 agreement."""
    cols = (np.asarray(numerators, dtype=np.float64), np.asarray(denominators, dtype=np.float64))
    return _interval(cols, lambda num, den, axis=-1: _ratio(num, den, axis), seed)


def confidence(per_prompt: list[list[int]], seed: int) -> dict:
    """95% CIs of one run's acceptance rate and length."""
    cols = _columns(per_prompt)
    return {"acceptance_rate_ci": _interval(cols, rate, seed), "acceptance_length_ci": _interval(cols, length, seed)}


def paired_difference(a: list[list[int]], b: list[list[int]], seed: int) -> dict:
    """b - a in acceptance rate and length on the same prompts, with CIs;
    ``distinguishable`` when the rate's interval excludes zero."""
    cols = (*_columns(a), *_columns(b))

    def rate_diff(*c, axis=-1):
        return rate(*c[3:], axis=axis) - rate(*c[:3], axis=axis)

    def length_diff(*c, axis=-1):
        return length(*c[3:], axis=axis) - length(*c[:3], axis=axis)

    rate_ci = _interval(cols, rate_diff, seed)
    return {"rate_difference": float(rate_diff(*cols)), "rate_difference_ci": rate_ci,
            "length_difference": float(length_diff(*cols)), "length_difference_ci": _interval(cols, length_diff, seed),
            "distinguishable": bool(rate_ci[0] > 0 or rate_ci[1] < 0)}
