"""How hidden states are stored in cache shards (``cache.dtype``).

bf16 / fp16 / fp32 store the values. fp8 stores E4M3 values with one fp32 scale per
token and row group (each of the 3 aux layers, and the final hidden state, is a group):
hidden states carry outliers up to ~2.5e4, so a per-tensor scale would flush most values
to zero, while per-token-per-layer scales keep E4M3's relative precision everywhere.
About half the bytes of bf16.
"""

from __future__ import annotations

import torch

from specft.quant.formats import get_format

PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CACHE_DTYPES = (*PLAIN_DTYPES, "fp8")
SCALE_SUFFIX = "_scale"
_E4M3 = get_format("e4m3")


def bytes_per_token(dtype: str, hidden_size: int, groups: int) -> int:
    """Exact storage bytes of one token's ``groups`` hidden states of ``hidden_size``:
    the values, and for fp8 one float32 scale per group."""
    if dtype == "fp8":
        return groups * (hidden_size + 4)
    return groups * hidden_size * PLAIN_DTYPES[dtype].itemsize


def encode(name: str, x: torch.Tensor, groups: int, dtype: str) -> dict[str, torch.Tensor]:
    """Tensors to store for ``x`` [T, groups * H] under ``name``."""
    if dtype == "fp16":  # saturate outliers rather than overflow to inf
        x = x.clamp(-65504, 65504)
    if dtype in PLAIN_DTYPES:
        return {name: x.to(PLAIN_DTYPES[dtype]).contiguous()}
    t = x.shape[0]
    g = x.float().reshape(t, groups, -1)
    amax = g.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / _E4M3.max_value, torch.ones_like(amax))
    q = (g / scale).clamp(-_E4M3.max_value, _E4M3.max_value).to(torch.float8_e4m3fn)
    return {name: q.reshape(t, -1).contiguous(), name + SCALE_SUFFIX: scale.reshape(t, groups).contiguous()}


def decode(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float32 hidden states from stored values (and per-token-per-group scales)."""
    if scale is None:
        return values.float()
    t, groups = scale.shape
    return (values.float().reshape(t, groups, -1) * scale[..., None]).reshape(t, -1)
