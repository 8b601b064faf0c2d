"""Stage-1 features as llama.cpp computes them (cache.engine=llamacpp): the inputs of the
decoder layers after specft's aux layers and the final norm's output, read through
specft-llama-probe from the GGUF file llama-server serves."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from specft.llamacpp.probe import run_probe

log = logging.getLogger(__name__)


class LlamaCppCapture:
    """``capture(input_ids, attention_mask) -> (aux [B, T, 3H], final [B, T, H])`` like
    target_model.FeatureCapture, computed by llama.cpp. specft's aux layer i is the output
    of decoder layer i, which llama.cpp hands out as the input of layer i + 1. Each row is
    decoded on its own, in one batch as llama-server processes a prompt, with the padding
    trimmed (rows are right-padded); padded positions come back as zeros."""

    def __init__(self, gguf: Path, aux_layer_ids: list[int], threads: int):
        self.gguf = gguf
        self.layers = tuple(i + 1 for i in aux_layer_ids)
        self.threads = threads

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        lengths = attention_mask.sum(dim=1).tolist()
        rows = [ids[:n].tolist() for ids, n in zip(input_ids, lengths)]
        result = run_probe(self.gguf, rows, layers=self.layers, logits=False, final=True, threads=self.threads)
        batch, length = input_ids.shape
        width = result.final[0].shape[-1]
        aux = np.zeros((batch, length, len(self.layers) * width), dtype=np.float32)
        final = np.zeros((batch, length, width), dtype=np.float32)
        for row, n in enumerate(lengths):
            aux[row, :n] = result.hidden[row].reshape(n, -1)  # [n, layers, H] -> [n, layers * H]
            final[row, :n] = result.final[row]
        return torch.from_numpy(aux), torch.from_numpy(final)
