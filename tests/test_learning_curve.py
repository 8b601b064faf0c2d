"""scripts/studies/learning_curve.py's projection: the tokens a log-linear acceptance curve would
need for a goal."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "studies"))


def _row(tokens: int, rate: float) -> dict:
    return {"quant": "mxfp4", "specft": {"acceptance_rate": rate}, "specft_tokens": {"answer_tokens": tokens},
            "baseline": None, "baseline_tokens": {}}


def test_projection_solves_the_fitted_line_for_each_goal():
    from learning_curve import projection

    fit = projection([_row(10_000, 0.20), _row(100_000, 0.37), _row(1_000_000, 0.54)], "specft", "mxfp4")
    assert fit["points_per_10x"] == pytest.approx(17.0)
    # 0.45 = 0.20 + 0.17 * (log10(n) - 4)
    assert fit["tokens_needed"]["0.45"] == pytest.approx(10 ** (4 + 0.25 / 0.17), rel=1e-9)
    assert math.log10(fit["tokens_needed"]["0.80"]) == pytest.approx(4 + 0.60 / 0.17)


def test_projection_needs_two_budgets_and_a_rising_line():
    from learning_curve import projection

    assert projection([_row(10_000, 0.2)], "specft", "mxfp4") is None
    assert projection([_row(10_000, 0.3), _row(100_000, 0.2)], "specft", "mxfp4") is None
    assert projection([_row(10_000, 0.2), _row(100_000, 0.3)], "baseline", "mxfp4") is None


def test_budgets_share_one_cache_root_unless_a_budget_already_has_its_own(tmp_path):
    """One root lets a larger budget reuse the answers a smaller one regenerated; a curve
    begun with a root per budget keeps finding its caches."""
    import argparse

    from learning_curve import cache_root

    a = argparse.Namespace(out_dir=tmp_path, cache_from=None)
    assert cache_root(a, 520) == cache_root(a, 1040) == tmp_path / "cache"
    (tmp_path / "budget-52" / "cache").mkdir(parents=True)
    assert cache_root(a, 52) == tmp_path / "budget-52" / "cache"
    other = tmp_path / "other"
    assert cache_root(argparse.Namespace(out_dir=tmp_path, cache_from=other), 520) == other / "cache"
