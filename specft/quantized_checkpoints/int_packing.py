"""Integer codes packed into int32 words, as GPTQ and AWQ checkpoints store them, and the
checks every such layer needs (tensor shapes, act-order group indices)."""

from __future__ import annotations

import torch

from specft.common.errors import SpecftError

# AWQ's GEMM kernel interleaves the 8 nibbles of a word: stored slot s holds column ORDER[s]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-wide codes, ``32 // bits`` to a word along ``dim``, the lowest
    bits first; returns int32 codes with ``dim`` grown by that factor."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    moved = packed.to(torch.int32).movedim(dim, -1)
    codes = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # arithmetic shift: the mask drops the sign
    return codes.flatten(-2).movedim(-1, dim)


def check_shape(tensor: torch.Tensor, want: tuple[int, ...], name: str, what: str) -> None:
    if tuple(tensor.shape) != want:
        raise SpecftError(f"model.path: {name} has shape {list(tensor.shape)}, but {what} needs {list(want)}")


def group_index(g_idx: torch.Tensor | None, in_features: int, group_size: int, name: str) -> torch.Tensor:
    """Each input channel's group: ``g_idx`` when stored (act-order GPTQ), checked to put
    exactly ``group_size`` channels in each group, else channel // group_size."""
    groups = -(-in_features // group_size)
    plain = torch.arange(in_features) // group_size
    if g_idx is None:
        return plain
    g_idx = g_idx.to(torch.int64).reshape(-1)
    if g_idx.numel() != in_features or not torch.equal(torch.sort(g_idx).values, plain):
        raise SpecftError(f"model.path: {name} is not a permutation of {groups} groups of {group_size} input "
                          f"channels ({g_idx.numel()} entries for {in_features} channels)")
    return g_idx
