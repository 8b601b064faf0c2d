"""Apply a quant config to a model: weights fake-quantized once, activations on the fly.

Covers every ``nn.Linear`` and the fused 3-D expert weights that transformers 5.x gives
Qwen3-MoE (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), which are not Linear
modules: their weights are quantized along the last (reduction) dimension, and their
forward is replaced by one that quantizes each expert's inputs too.
"""

from __future__ import annotations

import fnmatch
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from specft.quant.fake_quant import TensorQuantSpec, fake_quant


@dataclass
class LayerReport:
    name: str
    kind: str  # "linear" | "experts" | "kept"
    weight_rel_mse: float | None = None


@dataclass
class QuantReport:
    layers: list[LayerReport] = field(default_factory=list)

    @property
    def quantized(self) -> list[LayerReport]:
        return [r for r in self.layers if r.kind != "kept"]

    @property
    def kept(self) -> list[LayerReport]:
        return [r for r in self.layers if r.kind == "kept"]

    def summary(self) -> str:
        errs = [r.weight_rel_mse for r in self.quantized if r.weight_rel_mse is not None]
        mean = sum(errs) / len(errs) if errs else 0.0
        kept = ", ".join(r.name for r in self.kept) or "none"
        return (f"quantized {len(self.quantized)} layers (mean weight rel. MSE {mean:.3e}); "
                f"kept in high precision: {kept}")


def _rel_mse(ref: torch.Tensor, q: torch.Tensor) -> float:
    ref = ref.double()
    denom = ref.pow(2).mean().item()
    return (q.double() - ref).pow(2).mean().item() / denom if denom > 0 else 0.0


def _quantize_param_(param: nn.Parameter, spec: TensorQuantSpec) -> float:
    with torch.no_grad():
        q = fake_quant(param.data, spec)
        err = _rel_mse(param.data, q)
        param.data.copy_(q)
    return err


def _activation_hook(spec: TensorQuantSpec):
    def hook(module, args):
        return (fake_quant(args[0], spec), *args[1:])

    return hook


def _is_fused_experts(module: nn.Module) -> bool:
    gu = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return isinstance(gu, nn.Parameter) and gu.dim() == 3 and isinstance(down, nn.Parameter)


def _quantized_experts_forward(spec: TensorQuantSpec):
    """The Qwen3-MoE experts loop with each expert GEMM's input quantized."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            if expert >= self.num_experts:
                continue
            token_idx, slot = torch.where(top_k_index == expert)
            x = fake_quant(hidden_states[token_idx], spec)
            gate, up = nn.functional.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
            h = fake_quant(self.act_fn(gate) * up, spec)
            h = nn.functional.linear(h, self.down_proj[expert])
            h = h * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out

    return forward


def _untie_lm_head(model: nn.Module) -> None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is not None and emb is not None and head.weight is emb.weight:
        head.weight = nn.Parameter(emb.weight.detach().clone())


def apply_quant(model: nn.Module, weight: TensorQuantSpec | None,
                activation: TensorQuantSpec | None, exclude: list[str]) -> QuantReport:
    """Quantize ``model`` in place; modules whose name matches an ``exclude`` glob stay
    in high precision. Returns what was quantized and the weight error per layer."""
    report = QuantReport()
    if weight is None and activation is None:
        return report
    if not any(fnmatch.fnmatch("lm_head", pat) for pat in exclude):
        _untie_lm_head(model)  # quantizing a tied head must not touch the embeddings
    for name, module in model.named_modules():
        is_linear = isinstance(module, nn.Linear)
        is_experts = _is_fused_experts(module)
        if not (is_linear or is_experts):
            continue
        if any(fnmatch.fnmatch(name, pat) for pat in exclude):
            report.layers.append(LayerReport(name, "kept"))
            continue
        if is_linear:
            err = _quantize_param_(module.weight, weight) if weight else None
            if activation is not None:
                module.register_forward_pre_hook(_activation_hook(activation))
            report.layers.append(LayerReport(name, "linear", err))
        else:
            err = None
            if weight is not None:
                errs = [_quantize_param_(module.gate_up_proj, weight),
                        _quantize_param_(module.down_proj, weight)]
                err = sum(errs) / 2
            if activation is not None:
                module.forward = types.MethodType(_quantized_experts_forward(activation), module)
            report.layers.append(LayerReport(name, "experts", err))
    return report
