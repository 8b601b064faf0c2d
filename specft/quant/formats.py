"""Element formats: the value grids low-bit numbers live on.

Every format rounds a tensor that has already been divided by its scale onto the format's
grid, with round-to-nearest-even and saturation at the format's largest finite value.
Arithmetic is exact: the grid step is a power of two, so x / step and the product back
are exact in float32 (and float64) for every value the formats can represent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """A sign + ebits exponent + mbits mantissa minifloat ("fn": no Inf, saturating)."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max_value: float
    # torch's own dtype for this format, if any: casting to it is exact round-to-nearest-
    # even and several times faster than the generic path (used for float32 inputs).
    native: torch.dtype | None = None

    @property
    def min_normal_exp(self) -> int:
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest binade, floor(log2(max_value)); MX scales use it."""
        return int(math.floor(math.log2(self.max_value)))

    @property
    def clip_threshold(self) -> float:
        """Magnitudes above this are clipped by saturation, not merely rounded."""
        return self.max_value + 2.0 ** (self.emax - self.mbits - 1)

    def round(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype == torch.float32:
            return x.clamp(-self.max_value, self.max_value).to(self.native).to(x.dtype)
        return self.round_generic(x)

    def round_generic(self, x: torch.Tensor) -> torch.Tensor:
        ax = x.abs()
        # frexp: ax = m * 2**e with m in [0.5, 1), so floor(log2 ax) = e - 1.
        _, exp = torch.frexp(ax)
        exp = (exp - 1).clamp(min=self.min_normal_exp)  # subnormals share the lowest step
        step = torch.exp2((exp - self.mbits).to(x.dtype))
        q = (torch.round(ax / step) * step).clamp(max=self.max_value)  # inf saturates too
        return torch.where(torch.isnan(x), x, torch.copysign(q, x))


@dataclass(frozen=True)
class IntFormat:
    """A signed symmetric integer grid [-qmax, qmax]."""

    name: str
    bits: int

    @property
    def max_value(self) -> float:
        return float(2 ** (self.bits - 1) - 1)

    @property
    def clip_threshold(self) -> float:
        return self.max_value + 0.5

    def round(self, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x).clamp(-self.max_value, self.max_value)


ELEMENT_FORMATS: dict[str, FloatFormat | IntFormat] = {
    "e4m3": FloatFormat("e4m3", ebits=4, mbits=3, bias=7, max_value=448.0,
                        native=getattr(torch, "float8_e4m3fn", None)),
    "e5m2": FloatFormat("e5m2", ebits=5, mbits=2, bias=15, max_value=57344.0,
                        native=getattr(torch, "float8_e5m2", None)),
    "e2m1": FloatFormat("e2m1", ebits=2, mbits=1, bias=1, max_value=6.0),
    "int8": IntFormat("int8", bits=8),
    "int4": IntFormat("int4", bits=4),
}


def get_format(name: str) -> FloatFormat | IntFormat:
    try:
        return ELEMENT_FORMATS[name]
    except KeyError:
        known = ", ".join(sorted(ELEMENT_FORMATS))
        raise KeyError(f"unknown element format {name!r}; known: {known}") from None
