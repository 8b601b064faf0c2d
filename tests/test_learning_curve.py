"""scripts/learning_curve.py's projection: the tokens a log-linear acceptance curve would
need for a goal."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


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
