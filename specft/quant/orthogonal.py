"""Orthogonal matrices for rotations: normalized Hadamard matrices and seeded random ones.

Hadamard orders: a power of two (Sylvester) times one Paley base (q + 1 for a prime
q = 3 mod 4; 2(q + 1) for a prime q = 1 mod 4), which covers the widths QuaRot-style
rotations meet in practice (SmolLM2's 576 = 36 x 16, Qwen3-32B's 5120 = 20 x 256). The
matrices are built in float64 and returned scaled by 1/sqrt(n), so H @ H.T = I.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from specft.common.errors import ConfigError
from specft.common.registry import Registry


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, int(q ** 0.5) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = Legendre symbol of (j - i) mod q."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley_1(q: int) -> torch.Tensor:
    """Order q + 1 for a prime q = 3 mod 4: I + [[0, 1], [-1, Q]] (Q antisymmetric)."""
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
    return torch.eye(q + 1, dtype=torch.float64) + s


def _paley_2(q: int) -> torch.Tensor:
    """Order 2(q + 1) for a prime q = 1 mod 4: C = [[0, 1], [1, Q]] (symmetric) with each
    0 entry replaced by [[1, -1], [-1, -1]] and each +-1 by +-[[1, 1], [1, -1]]."""
    c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
    zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, one) + torch.kron((c == 0).double(), zero)


def _paley_base(m: int) -> torch.Tensor | None:
    if m == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return _paley_1(m - 1)
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return _paley_2(m // 2 - 1)
    return None


def _sylvester(h: torch.Tensor, n: int) -> torch.Tensor:
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@lru_cache(maxsize=16)
def _hadamard(n: int) -> torch.Tensor:
    # The smallest base wins, so a power of two is pure Sylvester (the fast Walsh-Hadamard
    # transform's matrix, as QuaRot's kernels use).
    m = n
    while m % 2 == 0:
        m //= 2
    while m <= n:
        base = _paley_base(m)
        if base is not None:
            return _sylvester(base, n) / n ** 0.5
        m *= 2
    raise ConfigError(f"quant.rotation: no Hadamard matrix of order {n} is known here (a power of two times "
                      "a Paley order q+1 or 2(q+1), q prime); use kind random")


def hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """The normalized n x n Hadamard matrix (``seed`` unused: Hadamard rotations are fixed)."""
    return _hadamard(n).clone()


def random_orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    """A Haar-random orthogonal matrix from a seeded Gaussian's QR (signs fixed by R's diagonal)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))[None, :]).contiguous()


ORTHOGONAL_KINDS: Registry = Registry("rotation kind")
ORTHOGONAL_KINDS.register("hadamard")(hadamard)
ORTHOGONAL_KINDS.register("random")(random_orthogonal)


def orthogonal(kind: str, n: int, seed: int = 0, field: str = "quant.rotation") -> torch.Tensor:
    """The float64 n x n orthogonal matrix of ``kind`` (hadamard | random)."""
    return ORTHOGONAL_KINDS.get(kind, field)(n, seed)
