"""Capture what the draft learns from: the outputs of 3 decoder layers and the final
post-norm hidden state (the lm_head input), via forward hooks, without computing logits."""

from __future__ import annotations

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_decoder().layers


def final_norm(model: nn.Module) -> nn.Module:
    return model.get_decoder().norm


class FeatureCapture:
    """Run the target's decoder and return (aux [B, T, 3H], final [B, T, H])."""

    def __init__(self, model: nn.Module, aux_layer_ids: list[int]):
        self.model = model
        self.aux_layer_ids = list(aux_layer_ids)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        captured: dict[int, torch.Tensor] = {}
        layers = decoder_layers(self.model)

        def make_hook(i):
            def hook(module, args, output):
                captured[i] = output[0] if isinstance(output, tuple) else output

            return hook

        handles = [layers[i].register_forward_hook(make_hook(i)) for i in self.aux_layer_ids]
        try:
            out = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                           use_cache=False)
        finally:
            for h in handles:
                h.remove()
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)
        return aux, out.last_hidden_state
