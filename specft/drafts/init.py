"""Start a draft's decoder layer from one of the target's decoder layers instead of at
random (draft.init=target_layer): an ablation with no published evidence either way.

The target layer's names are the Llama/Qwen3 ones (self_attn.{q,k,v,o}_proj, q/k norm,
mlp.*, input_layernorm, post_attention_layernorm), which the draft's layer shares. An
EAGLE-3 first layer reads [norm(embedding); norm(hidden)] (2H): its q/k/v get the target's
weights on the hidden half and zeros on the embedding half, so at step 0 the layer
computes what the target's layer computes on the fused features, and training learns
how much of the token to mix in."""

from __future__ import annotations

import torch
from torch import nn


def copy_layer_(draft_layer: nn.Module, target_layer: nn.Module, input_norm: str = "input_layernorm") -> list[str]:
    """Copy every tensor the two layers share by name and shape; a q/k/v projection the
    draft reads at twice the width gets the target's weights on its second half and zeros
    on its first. ``input_norm``: the draft's norm that plays the target's input norm.
    Returns the names copied."""
    theirs = dict(target_layer.named_parameters())
    theirs[input_norm] = theirs.pop("input_layernorm.weight")
    copied = []
    with torch.no_grad():
        for name, mine in draft_layer.named_parameters():
            src = theirs.get(name if name != f"{input_norm}.weight" else input_norm)
            if src is None:
                continue
            if src.shape == mine.shape:
                mine.copy_(src)
            elif mine.dim() == 2 and mine.shape == (src.shape[0], 2 * src.shape[1]):
                mine.zero_()
                mine[:, src.shape[1]:] = src
            else:
                continue
            copied.append(name)
    return copied


def load_target_layer(model_cfg, index: int | None) -> nn.Module:
    """Decoder layer ``index`` (null: the last) of the target's 16-bit checkpoint."""
    from specft.target_model import load_target

    model, _ = load_target(model_cfg)
    layers = model.get_decoder().layers
    return layers[len(layers) - 1 if index is None else index]
