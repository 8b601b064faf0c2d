"""Apply a quant config to a model: weights fake-quantized once, activations on the fly.

Covers every ``nn.Linear`` and the fused 3-D expert weights that transformers 5.x gives
Qwen3-MoE (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), which are not Linear
modules: their weights are quantized along the last (reduction) dimension, and their
forward is replaced by one that quantizes each expert's inputs too. The KV cache is
quantized inside an attention function registered with transformers, so keys are
quantized after RoPE, as serving engines store them.
"""

from __future__ import annotations

import fnmatch
import types
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from specft.common.errors import ConfigError
from specft.quant.config import QuantConfig
from specft.quant.fake_quant import TensorQuantSpec, fake_quant, static_scale
from specft.quant.model_hooks import (
    experts_forward,
    full_shape,
    fused_experts,
    input_shard_group,
    install_attention_transform,
    plain_weights,
    untie_lm_head,
)
from specft.quant.rotation import rotate_model


class ActivationQuantizer:
    """Quantizes one tensor stream. Dynamic specs compute scales per call; static specs
    record the running amax while calibrating, then use the frozen per-tensor scale."""

    def __init__(self, spec: TensorQuantSpec):
        self.spec = spec
        self.spec_key = tuple(vars(spec).values())  # equal keys quantize identically
        self.calibrating = not spec.dynamic
        self.amax = torch.zeros(())
        self.scale: torch.Tensor | None = None
        # Tensor parallel: the group over which this input's last dim is split; amax-based
        # scales are then reduced over it so each token gets its full row's scale.
        self.shard_group = None

    def _reduced_amax(self, amax: torch.Tensor) -> torch.Tensor:
        if self.shard_group is not None:
            import torch.distributed as dist

            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.shard_group)
        return amax

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.dynamic and self.shard_group is not None and self.spec.scheme in ("token", "tensor"):
            dims = (-1,) if self.spec.scheme == "token" else tuple(range(x.dim()))
            amax = self._reduced_amax(x.detach().abs().amax(dim=dims, keepdim=True).float())
            return fake_quant(x, self.spec, static_scale(amax, self.spec).to(x.dtype))
        if self.spec.dynamic:
            return fake_quant(x, self.spec)
        if self.calibrating:
            amax = self._reduced_amax(x.detach().abs().amax().float())
            self.amax = torch.maximum(self.amax, amax.cpu())
            return x
        if self.scale is None:
            raise RuntimeError("static activation scale used before calibration")
        return fake_quant(x, self.spec, self.scale.to(x.device))

    @property
    def share_key(self):
        """Equal keys quantize a tensor identically (SharedInput); None: always run (a
        static scale of its own, or a tensor-parallel reduction)."""
        return self.spec_key if self.spec.dynamic and self.shard_group is None else None

    def freeze(self) -> None:
        self.calibrating = False
        self.scale = static_scale(self.amax, self.spec)


class SharedInput:
    """Linears that read one tensor (q/k/v after the same norm, gate/up) quantize it once.

    Holds the last input (a reference, so its identity cannot be reused) with its version
    counter and quantized copy; a call on the same, unmodified tensor with an equal
    ``share_key`` returns that copy. Quantizers whose key is None (static or
    tensor-parallel ones: each keeps its own scale or reduction) always run. Any
    quantizer with a ``share_key`` may use it: emulated formats and a checkpoint's alike."""

    def __init__(self):
        self.x = self.version = self.key = self.out = None

    def __call__(self, quant, x: torch.Tensor) -> torch.Tensor:
        key = quant.share_key
        if key is None:
            return quant(x)
        if x is self.x and x._version == self.version and key == self.key:
            return self.out
        out = quant(x)
        self.x, self.version, self.key, self.out = x, x._version, key, out
        return out


@dataclass
class LayerReport:
    name: str
    kind: str  # "linear" | "experts" | "kept"
    weight_rel_mse: float | None = None


@dataclass
class QuantReport:
    layers: list[LayerReport] = field(default_factory=list)
    quantizers: list[ActivationQuantizer] = field(default_factory=list, repr=False)
    kv_quantized: bool = False
    checkpoint: dict | None = None  # quant=checkpoint: the family, its scheme(s), each layer's
    rotation: dict | None = None  # quant.rotation: each rotation's kind and size

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
        kv = "; KV cache quantized" if self.kv_quantized else ""
        kv += f"; rotated ({', '.join(self.rotation)})" if self.rotation else ""
        if self.checkpoint is not None:
            return (f"{self.checkpoint['family']} checkpoint ({self.checkpoint['summary']}): "
                    f"{len(self.quantized)} quantized layers; kept in high precision: {kept}")
        return (f"quantized {len(self.quantized)} layers (mean weight rel. MSE {mean:.3e}); "
                f"kept in high precision: {kept}{kv}")

    def to_dict(self) -> dict:
        out = {"layers": [vars(r) for r in self.layers], "kv_quantized": self.kv_quantized,
               "static_scales": [float(q.scale) for q in self.quantizers if q.scale is not None]}
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint
        if self.rotation is not None:
            out["rotation"] = self.rotation
        return out


def _rel_mse(ref: torch.Tensor, q: torch.Tensor) -> float:
    ref = ref.double()
    denom = ref.pow(2).mean().item()
    return (q.double() - ref).pow(2).mean().item() / denom if denom > 0 else 0.0


def _quantize_param_(param: nn.Parameter, spec: TensorQuantSpec, edit=plain_weights) -> float:
    with torch.no_grad(), edit(param) as full:
        q = fake_quant(full, spec)
        err = _rel_mse(full, q)
        full.copy_(q)
    return err


def _is_fused_experts(module: nn.Module) -> bool:
    gu = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return isinstance(gu, nn.Parameter) and len(full_shape(gu)) == 3 and isinstance(down, nn.Parameter)


def _install_kv_quant(model: nn.Module, spec: TensorQuantSpec, report: QuantReport) -> None:
    """Keys (after RoPE) and values quantized before attention reads them. Per-token
    scales are idempotent, so re-quantizing past cache entries at every step changes nothing."""
    quant_k, quant_v = ActivationQuantizer(spec), ActivationQuantizer(spec)
    report.quantizers += [quant_k, quant_v]
    install_attention_transform(model, lambda q, k, v: (q, quant_k(k), quant_v(v)))
    report.kv_quantized = True


def apply_quant(model: nn.Module, cfg: QuantConfig, edit=plain_weights) -> QuantReport:
    """Quantize ``model`` in place; modules whose name matches an ``exclude`` glob stay
    in high precision. Returns what was quantized and the weight error per layer; static
    activation scales still need ``calibrate``. ``edit`` gives each weight's full tensor
    (one parameter at a time when the model is sharded)."""
    if cfg.from_checkpoint:
        return apply_checkpoint_quant(model)
    report = QuantReport()
    if cfg.rotation is not None:
        report.rotation = rotate_model(model, cfg.rotation, edit)
    if cfg.weight is None and cfg.activation is None and cfg.kv is None:
        return report
    if not any(fnmatch.fnmatch("lm_head", pat) for pat in cfg.exclude):
        untie_lm_head(model)  # quantizing a tied head must not touch the embeddings
    shared = SharedInput()
    for name, module in model.named_modules():
        is_linear = isinstance(module, nn.Linear)
        is_experts = _is_fused_experts(module)
        if not (is_linear or is_experts):
            continue
        if any(fnmatch.fnmatch(name, pat) for pat in cfg.exclude):
            report.layers.append(LayerReport(name, "kept"))
            continue
        if is_linear:
            err = _quantize_param_(module.weight, cfg.weight, edit) if cfg.weight else None
            if cfg.activation is not None:
                quant = ActivationQuantizer(cfg.activation)
                quant.shard_group = input_shard_group(module.weight)
                report.quantizers.append(quant)
                module.register_forward_pre_hook(lambda m, args, q=quant: (shared(q, args[0]), *args[1:]))
            report.layers.append(LayerReport(name, "linear", err))
        else:
            err = None
            if cfg.weight is not None:
                err = (_quantize_param_(module.gate_up_proj, cfg.weight, edit)
                       + _quantize_param_(module.down_proj, cfg.weight, edit)) / 2
            if cfg.activation is not None:
                if input_shard_group(module.down_proj, dim=2) is not None:
                    raise ConfigError(f"quant.activation: {name} is split by a tensor-parallel plan; quantized "
                                      "activations inside fused MoE experts need cache.sharding=zero3")
                q_in, q_mid = ActivationQuantizer(cfg.activation), ActivationQuantizer(cfg.activation)
                report.quantizers += [q_in, q_mid]
                module.forward = types.MethodType(experts_forward(q_in, q_mid), module)
            report.layers.append(LayerReport(name, "experts", err))
    if cfg.kv is not None:
        _install_kv_quant(model, cfg.kv, report)
    return report


def apply_checkpoint_quant(model: nn.Module) -> QuantReport:
    """quant=checkpoint: the weights were dequantized when the checkpoint loaded
    (target loader); here each quantized layer gets the input quantization the checkpoint
    records. The report names every layer's scheme (quant_report.json, specft info)."""
    ckpt = getattr(model, "specft_checkpoint", None)
    if ckpt is None:
        raise ConfigError("quant=checkpoint: the target was not loaded from a quantized checkpoint")
    report = QuantReport(checkpoint=ckpt.to_dict())
    shared = SharedInput()
    for name, module in model.named_modules():
        layer = ckpt.layers.get(name)
        if layer is None:
            if isinstance(module, nn.Linear):
                report.layers.append(LayerReport(name, "kept"))
            continue
        if layer.quantize_input is not None:
            module.register_forward_pre_hook(lambda m, args, q=layer.quantize_input: (shared(q, args[0]), *args[1:]))
        if layer.forward is not None:
            module.forward = layer.forward
        report.layers.append(LayerReport(name, "linear"))
    _install_experts(model, ckpt, report)
    for transform in ckpt.attention:
        install_attention_transform(model, transform)
    return report


def _install_experts(model: nn.Module, ckpt, report: QuantReport) -> None:
    """A Mixture-of-Experts checkpoint's per-expert layers, fused by the loader: weight-only
    ones run as transformers runs them; dynamically quantized inputs (the same quantizers
    for every expert) run through the quantized experts loop. Reported either way."""
    for name, module in fused_experts(model).items():
        if not any(n.startswith(name + ".") for n in ckpt.layers):
            continue
        quantizers = ckpt.experts.get(name)
        if quantizers is not None:
            module.forward = types.MethodType(experts_forward(*quantizers), module)
        report.layers.append(LayerReport(name, "experts"))


@contextmanager
def calibrating(report: QuantReport):
    """Inside: static quantizers record amax and pass values through. On exit: frozen."""
    yield
    for q in report.quantizers:
        if q.calibrating:
            q.freeze()


@torch.no_grad()
def calibrate(model: nn.Module, report: QuantReport, batches) -> None:
    """Run ``batches`` (dicts of model inputs) to fix static activation scales."""
    with calibrating(report):
        for batch in batches:
            model(**batch)
