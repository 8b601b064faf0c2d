"""Quantization-aware training of the draft: its linear layers compute with weights and
inputs fake-quantized in the deployment format, with straight-through gradients, so the
4/8-bit draft that ships is the one that was trained. The state dict keeps its names and
full-precision master weights; export quantizes them the same way."""

from __future__ import annotations

import fnmatch
import types

import torch.nn.functional as F
from torch import nn

from specft.common.errors import ConfigError
from specft.quant.config import QuantConfig
from specft.quant.fake_quant import fake_quant_ste


def _qat_forward(cfg: QuantConfig):
    def forward(self, x):
        if cfg.activation is not None:
            x = fake_quant_ste(x, cfg.activation)
        w = fake_quant_ste(self.weight, cfg.weight) if cfg.weight is not None else self.weight
        return F.linear(x, w, self.bias)

    return forward


def apply_draft_qat(draft: nn.Module, cfg: QuantConfig) -> list[str]:
    """Switch the draft's Linear layers (except ``cfg.exclude`` matches) to QAT forwards;
    returns the names of the layers switched."""
    if cfg.activation is not None and not cfg.activation.dynamic:
        raise ConfigError(f"draft.quant={cfg.name}: QAT supports dynamic activation scales only")
    switched = []
    for name, module in draft.named_modules():
        if isinstance(module, nn.Linear) and not any(fnmatch.fnmatch(name, p) for p in cfg.exclude):
            module.forward = types.MethodType(_qat_forward(cfg), module)
            switched.append(name)
    return switched
