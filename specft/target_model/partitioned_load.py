"""A quantized checkpoint loaded straight into ZeRO-3 partitions (cache.sharding=zero3).

transformers loads a 16-bit checkpoint into a model built under ``deepspeed.zero.Init``
file by file; a quantized checkpoint is dequantized by specft's families instead, so it
needs its own path. Every rank reads the checkpoint in the same order (the families walk
the model's modules; ``LazyTensors`` reads one layer's stored tensors at a time) and hands
each dense tensor, as soon as it is made, to ``PartitionWriter``: the parameter is gathered,
written, and partitioned again (GatheredParameters with rank 0 as the writer; every rank
made the same tensor). No rank holds more than one dense layer (one layer's experts for a
Mixture-of-Experts model) beside its partition, and the written model is the one a
one-rank load builds, value for value.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from specft.common.errors import ConfigError
from specft.quantized_checkpoints.base import release_freed_memory
from specft.quantized_checkpoints.experts import ExpertPieces


@contextmanager
def zero3_edit(param: nn.Parameter):
    """The full tensor of a ZeRO-3 parameter; edits on rank 0 are partitioned again."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        yield param.data


class PartitionWriter:
    """Writes dense tensors into the model's (partitioned) parameters by state-dict name."""

    def __init__(self, model: nn.Module, edit, tied: set[str]):
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.edit, self.tied = edit, tied
        self.pieces = ExpertPieces(model)
        self.written: set[str] = set()

    def __call__(self, key: str, tensor: torch.Tensor) -> None:
        if key in self.tied:
            return  # the tied head is the embedding, written under its own name
        fused = self.pieces.add(key, tensor)
        if fused is None:
            self._write(key, tensor)
        for name, value in (fused or {}).items():
            self._write(name, value)

    def _write(self, key: str, tensor: torch.Tensor) -> None:
        param = self.params.get(key)
        if param is None:
            raise ConfigError(f"model.path: the checkpoint does not fit its model (unexpected {key})")
        with torch.no_grad(), self.edit(param) as full:
            if tuple(full.shape) != tuple(tensor.shape):
                raise ConfigError(f"model.path: {key} has shape {list(tensor.shape)} in the checkpoint, but the "
                                  f"model's is {list(full.shape)}")
            full.copy_(tensor)
        self.written.add(key)
        release_freed_memory()  # the gathered copy just freed, between kept partitions

    def finish(self, state: dict[str, torch.Tensor]) -> None:
        """The tensors the family left in ``state`` (16-bit ones: norms, embeddings), then
        a check that every parameter was written."""
        for key in list(state):
            self(key, state.pop(key))
        self.pieces.finish()
        missing = sorted(set(self.params) - self.written - self.tied)
        if missing:
            raise ConfigError(f"model.path: the checkpoint does not fit its model (missing {missing[0]})")
