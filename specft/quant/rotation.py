"""Rotations of a target before it is quantized, as QuaRot / SpinQuant / msModelSlim's
QuaRot serve it. Rotations spread outliers across channels, so low-bit activations lose
less; they also rotate every hidden state a draft reads.

- R1 (``residual``): the residual stream becomes x @ R1. Folded offline: the embedding
  rows, every Linear reading the stream (q/k/v, gate/up, the MoE router and experts,
  lm_head) as W @ R1, every Linear writing it (o_proj, down_proj) as R1.T @ W. RMSNorm
  commutes with R1 only without its scale, so each norm's weight is first fused into the
  Linears that read it and set to ones (QuaRot's "fuse layer norms"). The draft then reads
  rotated aux states and a rotated embedding; `specft fold-rotation` turns a 16-bit draft
  into one that does.
- R2 (``head``): per attention head on the values, folded into v_proj's rows and
  o_proj's columns.
- R3 (``online_qk``): queries and keys rotated per head after RoPE, at run time (their
  dot products are unchanged; what changes is the KV cache's quantization).
- R4 (``online_down``): down_proj's input rotated at run time, its weight by the same
  matrix offline.

Folding runs in float64 and casts back to the weight's dtype. Supported layouts: the
Llama / Qwen3 / Qwen3-MoE decoder (input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj or mlp.gate + fused experts).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import nn

from specft.common.errors import ConfigError
from specft.quant.model_hooks import (
    experts_forward,
    input_shard_group,
    install_attention_transform,
    plain_weights,
    untie_lm_head,
)
from specft.quant.orthogonal import orthogonal


@dataclass
class RotationSpec:
    """Which rotations the target is served with; each is a kind (hadamard | random) or null."""

    residual: str | None = "hadamard"  # R1
    head: str | None = None  # R2
    online_qk: str | None = None  # R3
    online_down: str | None = None  # R4
    seed: int = 0  # random kinds; R1 uses it, the others seed + 1, + 2, + 3


def _fold(param: nn.Parameter, edit, fn) -> None:
    """param <- fn(param in float64), through the weight editor (sharded targets)."""
    with torch.no_grad(), edit(param) as full:
        full.copy_(fn(full.double()).to(full.dtype))


def _layer_parts(layer: nn.Module, where: str):
    """(input readers, output writers, post-attention readers, down_proj or the fused
    experts) of one decoder layer; an unknown layout is one clear error."""
    try:
        attn, mlp = layer.self_attn, layer.mlp
        readers = [attn.q_proj, attn.k_proj, attn.v_proj]
        writers = [attn.o_proj]
        if hasattr(mlp, "experts"):
            mlp_readers, down = [mlp.gate, mlp.experts], mlp.experts
        else:
            mlp_readers, down = [mlp.gate_proj, mlp.up_proj], mlp.down_proj
        return readers, writers + [down], mlp_readers, down
    except AttributeError as e:
        raise ConfigError(f"quant.rotation: {where} is not a Llama/Qwen3 decoder layer ({e})") from None


def _reader_weights(module: nn.Module) -> list[nn.Parameter]:
    """Weights whose last dim reads the residual stream."""
    return [module.gate_up_proj] if hasattr(module, "gate_up_proj") else [module.weight]


def _writer_weights(module: nn.Module) -> list[tuple[nn.Parameter, int]]:
    """(weight, the dim that writes the residual stream) of a writer: [H, I] Linears on
    dim 0, fused experts' down_proj [E, H, I] on dim 1."""
    return [(module.down_proj, 1)] if hasattr(module, "down_proj") else [(module.weight, 0)]


def _fuse_norm_and_rotate(norm: nn.Module, readers: list[nn.Module], r1: torch.Tensor, edit) -> None:
    """Readers' W <- (W * gamma) @ R1, then gamma <- 1: norm(x @ R1) = norm(x) @ R1 without a scale."""
    with torch.no_grad(), edit(norm.weight) as full:  # through the editor: ZeRO-3 partitions norms too
        gamma = full.double().clone()
        full.fill_(1.0)
    for module in readers:
        for w in _reader_weights(module):
            _fold(w, edit, lambda t: (t * gamma) @ r1)


def _rotate_writer(module: nn.Module, r1: torch.Tensor, edit) -> None:
    for w, dim in _writer_weights(module):
        _fold(w, edit, lambda t, d=dim: torch.movedim(torch.movedim(t, d, -1) @ r1, -1, d))
    if getattr(module, "bias", None) is not None:
        _fold(module.bias, edit, lambda b: b @ r1)


def _rotate_values(attn: nn.Module, r2: torch.Tensor, head_dim: int, edit) -> None:
    """v_proj's rows and bias per head @ R2; o_proj's columns per head @ R2."""
    def per_head_rows(t):  # [n*d, H] -> rows of each head rotated
        return (t.T.reshape(t.shape[1], -1, head_dim) @ r2).reshape(t.shape[1], -1).T

    _fold(attn.v_proj.weight, edit, per_head_rows)
    if attn.v_proj.bias is not None:
        _fold(attn.v_proj.bias, edit, lambda b: (b.reshape(-1, head_dim) @ r2).reshape(-1))
    _fold(attn.o_proj.weight, edit, lambda t: (t.reshape(t.shape[0], -1, head_dim) @ r2).reshape(t.shape[0], -1))


def _online(matrix: torch.Tensor):
    """x -> x @ matrix in x's dtype (matrix cast once per dtype)."""
    cast: dict[torch.dtype, torch.Tensor] = {}

    def apply(x: torch.Tensor) -> torch.Tensor:
        m = cast.get(x.dtype)
        if m is None or m.device != x.device:
            m = cast[x.dtype] = matrix.to(device=x.device, dtype=x.dtype)
        return x @ m

    return apply


def _install_online_down(down: nn.Module, r4: torch.Tensor, edit) -> None:
    """down_proj's input @ R4 at run time, its weight @ R4 offline. Fused experts run the
    experts loop (model_hooks.experts_forward), which rotates each expert's down_proj input."""
    weight, dim = (down.down_proj, 2) if hasattr(down, "gate_up_proj") else (down.weight, 1)
    if input_shard_group(weight, dim) is not None:  # each rank would rotate a slice of the row
        raise ConfigError("quant.rotation.online_down: down_proj's input is split by a tensor-parallel plan; "
                          "use cache.sharding=zero3 or none")
    rotate = _online(r4)
    if hasattr(down, "gate_up_proj"):
        _fold(down.down_proj, edit, lambda t: t @ r4)
        down.specft_mid_transform = rotate
        down.forward = types.MethodType(experts_forward(_identity, _identity), down)
        return
    _fold(down.weight, edit, lambda t: t @ r4)
    down.register_forward_pre_hook(lambda m, args: (rotate(args[0]), *args[1:]))


def _down_input_width(down: nn.Module) -> int:
    if hasattr(down, "gate_up_proj"):
        return getattr(down.down_proj, "ds_shape", down.down_proj.shape)[-1]  # ZeRO-3: the real shape
    return down.in_features


def _identity(x):
    return x


def rotate_model(model: nn.Module, spec: RotationSpec, edit=plain_weights) -> dict:
    """Fold ``spec``'s rotations into ``model`` in place and install its online ones (before
    any quantizer, so the quantizers see rotated tensors). Returns the record for
    quant_report.json: each rotation's kind and size."""
    config = model.config
    hidden, head_dim = config.hidden_size, \
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = model.get_decoder().layers
    parts = [_layer_parts(layer, f"layer {i}") for i, layer in enumerate(layers)]
    record = {}
    if spec.residual:
        untie_lm_head(model)  # the head reads R1 @ gamma, the embedding only R1
        r1 = orthogonal(spec.residual, hidden, spec.seed)
        _fold(model.get_input_embeddings().weight, edit, lambda t: t @ r1)
        for layer, (readers, writers, mlp_readers, _) in zip(layers, parts):
            _fuse_norm_and_rotate(layer.input_layernorm, readers, r1, edit)
            _fuse_norm_and_rotate(layer.post_attention_layernorm, mlp_readers, r1, edit)
            for module in writers:
                _rotate_writer(module, r1, edit)
        _fuse_norm_and_rotate(model.get_decoder().norm, [model.get_output_embeddings()], r1, edit)
        record["residual"] = {"kind": spec.residual, "size": hidden, "seed": spec.seed}
    if spec.head:
        r2 = orthogonal(spec.head, head_dim, spec.seed + 1)
        for layer in layers:
            _rotate_values(layer.self_attn, r2, head_dim, edit)
        record["head"] = {"kind": spec.head, "size": head_dim}
    if spec.online_down:
        width = _down_input_width(parts[0][3])
        r4 = orthogonal(spec.online_down, width, spec.seed + 3)
        for *_, down in parts:
            _install_online_down(down, r4, edit)
        record["online_down"] = {"kind": spec.online_down, "size": width}
    if spec.online_qk:
        rotate = _online(orthogonal(spec.online_qk, head_dim, spec.seed + 2))
        install_attention_transform(model, lambda q, k, v: (rotate(q), rotate(k), v))
        record["online_qk"] = {"kind": spec.online_qk, "size": head_dim}
    return record
