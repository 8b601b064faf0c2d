"""Activations as llama.cpp's CPU build quantizes them before each matrix product.

ggml multiplies a weight of type T by an activation converted to T's ``vec_dot_type``
(ggml-cpu.c, type_traits_cpu): F16 weights take F16 activations, Q4_0/Q5_0/Q8_0/IQ4_NL
and the FP4 types (MXFP4, NVFP4) take Q8_0 blocks of 32, Q4_1/Q5_1 take Q8_1 blocks of 32,
the K-quants and the other i-quants (IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S) take
Q8_K blocks of 256. The integer dot products are exact, so the product equals the
dequantized weight times the dequantized activation up to float32 summation order, which
is what specft computes. The rounding here is the x86 path's (ggml-cpu/arch/x86/quants.c, repack.cpp),
checked against the engine itself (scripts/checks/check_llamacpp.py, tests/test_llamacpp.py):

- Q8_0 / Q8_1: ``d = amax / 127`` stored as F16, codes ``round_half_even(x * (127 / amax))``
  (AVX ``_mm256_round_ps``; the scalar reference rounds ties away from zero instead).
  Q8_1 also stores ``s = F16(d * sum(codes))`` with d unrounded; Q4_1/Q5_1 weights add
  ``min * s`` per block, so the product is not weight x dequantized activation alone: see
  ``q8_1_correction``.
- Q8_K: one float32 scale per 256: ``iscale = 127 / amax`` (the reference takes
  ``-127 / max`` with max the signed value of largest magnitude: the same codes negated),
  codes ``round_half_even(x * iscale)``, ``d = 1 / iscale``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Q8_BLOCK = 32
QK_K = 256


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // size, size)


def _div(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """float32 ``numerator / denominator`` rounded as C's division is (PyTorch's float32
    reciprocal can be an ulp off); 0 where the denominator is 0. A float64 quotient rounded
    once more to float32 is the correctly rounded float32 quotient."""
    nonzero = denominator != 0
    quotient = numerator / torch.where(nonzero, denominator, 1.0).to(torch.float64)
    return torch.where(nonzero, quotient.to(torch.float32), 0.0)


def _codes(blocks: torch.Tensor, iscale: torch.Tensor) -> torch.Tensor:
    return torch.round(blocks * iscale)  # ties to even, as _mm256_round_ps(_MM_ROUND_NEAREST)


def _q8_32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, F16 scale as float32, float32 scale) of Q8_0/Q8_1 blocks."""
    blocks = _blocks(x, Q8_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = (amax.to(torch.float64) / 127.0).to(torch.float32)
    return _codes(blocks, _div(127.0, amax)), d.to(torch.float16).to(torch.float32), d


def q8_0(x: torch.Tensor) -> torch.Tensor:
    codes, d16, _ = _q8_32(x)
    return (codes * d16).reshape(x.shape).to(x.dtype)


def q8_1_correction(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as Q8_1 dequantized, per-block correction [..., n/32]): a Q4_1/Q5_1 product is
    ``W_deq @ x_deq + mins @ correction``, where the correction is what the stored F16
    ``s`` differs from ``d16 * sum(codes)`` by."""
    codes, d16, d = _q8_32(x)
    total = codes.sum(-1, keepdim=True)
    s = (d * total).to(torch.float16).to(torch.float32)
    return (codes * d16).reshape(x.shape).to(x.dtype), (s - d16 * total).squeeze(-1)


def q8_k(x: torch.Tensor) -> torch.Tensor:
    blocks = _blocks(x, QK_K)
    amax = blocks.abs().amax(-1, keepdim=True)
    iscale = _div(127.0, amax)
    d = _div(1.0, iscale)
    return (_codes(blocks, iscale).clamp(max=127) * d).reshape(x.shape).to(x.dtype)


def f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(x.dtype)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


class GgmlInput:
    """One vec_dot_type's rounding as a checkpoint input quantizer: layers reading the same
    input with the same vec_dot_type (q/k/v, gate/up) share one rounding of it."""

    def __init__(self, vec_dot_type: str, fn: Callable[[torch.Tensor], torch.Tensor]):
        self.share_key, self.fn = f"ggml-{vec_dot_type}", fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


# vec_dot_type name -> (block size the row must divide into, the activation's rounding)
ACTIVATIONS: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q8_0": (Q8_BLOCK, q8_0),
    "Q8_K": (QK_K, q8_k),
    "F16": (1, f16),
    "BF16": (1, bf16),
}

# weight type -> its vec_dot_type on the CPU (ggml-cpu.c type_traits_cpu); Q8_1 is handled
# with the weight's block minimums (gguf_family.py). Types not listed are refused. The FP4
# types (MXFP4: E2M1 in blocks of 32 under an E8M0 scale; NVFP4: E2M1 in blocks of 64 under
# four UE4M3 scales) and the i-quants multiply their dequantized value grid by integer
# codes in the same way, so weight x dequantized activation is their product too.
VEC_DOT_TYPE = {
    "F32": None, "F16": "F16", "BF16": "BF16",
    "Q8_0": "Q8_0", "Q4_0": "Q8_0", "Q5_0": "Q8_0", "IQ4_NL": "Q8_0",
    "MXFP4": "Q8_0", "NVFP4": "Q8_0",
    "Q4_1": "Q8_1", "Q5_1": "Q8_1",
    "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K",
    "IQ4_XS": "Q8_K", "IQ3_XXS": "Q8_K", "IQ3_S": "Q8_K", "IQ2_XXS": "Q8_K", "IQ2_XS": "Q8_K",
    "IQ2_S": "Q8_K",
}
