"""Where quantizers and rotations reach into a transformers model: the attention function
(queries, keys and values after RoPE), the fused MoE experts loop, a tied head, and the
tensor-parallel group a row-parallel input is split over. apply.py and rotation.py both
hook in here, in the order they are installed."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def plain_weights(param: nn.Parameter):
    """The default weight editor: the parameter's own tensor. Sharded targets pass one
    that gathers the full tensor and scatters the edit back (target/sharding.py)."""
    yield param.data


def untie_lm_head(model: nn.Module) -> None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is not None and emb is not None and head.weight is emb.weight:
        head.weight = nn.Parameter(emb.weight.detach().clone())


def install_attention_transform(model: nn.Module, transform) -> None:
    """Run ``transform(query, key, value) -> (query, key, value)`` on every attention call,
    after RoPE and before attention reads them (keys as serving engines store them).
    Transforms run in the order installed (a rotation before the KV cache's quantizer).
    A transform whose ``takes_module`` is true also gets the attention module (a
    checkpoint's per-layer KV scales look up its ``layer_idx``)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    chain = getattr(model, "specft_attention_transforms", None)
    if chain is not None:
        chain.append(transform)
        return
    chain = model.specft_attention_transforms = [transform]
    base_name = model.config._attn_implementation or "sdpa"
    base = ALL_ATTENTION_FUNCTIONS[base_name] if base_name != "eager" else None

    def attention(module, query, key, value, attention_mask, **kwargs):
        for step in chain:
            query, key, value = (step(query, key, value, module) if getattr(step, "takes_module", False)
                                 else step(query, key, value))
        if base is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward

            return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return base(module, query, key, value, attention_mask, **kwargs)

    name = f"specft_attention_{id(model)}"
    AttentionInterface.register(name, attention)
    # transformers builds no attention mask at all for a name it has no mask function for
    # (it assumes an engine that masks by itself): padding, cache holes and the causal
    # offset of a multi-token step on a cache would all be lost. The base's mask it is.
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base_name])
    model.set_attn_implementation(name)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's whole shape; ZeRO-3 leaves an empty placeholder in .data and keeps
    the real shape as ds_shape."""
    return tuple(getattr(param, "ds_shape", param.shape))


def fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """name -> every module holding a layer's experts as 3-D gate_up_proj / down_proj."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and len(full_shape(m.gate_up_proj)) == 3}


def experts_forward(quant_in, quant_mid):
    """The Qwen3-MoE experts loop with each expert GEMM's input quantized (identity
    quantizers for none). An online rotation of the down_proj input
    (``specft_mid_transform``, quant/rotation.py) runs before its quantizer."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        rotate_mid = getattr(self, "specft_mid_transform", None)
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            if expert >= self.num_experts:
                continue
            token_idx, slot = torch.where(top_k_index == expert)
            x = quant_in(hidden_states[token_idx])
            gate, up = nn.functional.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
            h = self.act_fn(gate) * up
            h = quant_mid(rotate_mid(h) if rotate_mid is not None else h)
            h = nn.functional.linear(h, self.down_proj[expert])
            h = h * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out

    return forward


def input_shard_group(weight: nn.Parameter, dim: int = 1):
    """The process group a row-parallel Linear splits its input over (weight [out, in]
    sharded on dim 1 by a tensor-parallel plan), else None."""
    from torch.distributed.tensor import DTensor, Shard

    data = weight.data
    if isinstance(data, DTensor) and any(isinstance(p, Shard) and p.dim == dim for p in data.placements):
        return data.device_mesh.get_group()
    return None
