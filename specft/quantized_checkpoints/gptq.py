"""GPTQ and AWQ checkpoints (``quantization_config.quant_method`` ``gptq`` / ``awq``): Qwen's
Qwen3-*-GPTQ-Int4 / -Int8 and Qwen3-*-AWQ releases, and what GPTQModel, AutoGPTQ, AutoAWQ
and AutoRound (its ``auto_gptq`` / ``auto_awq`` exports) write.

Both store a Linear as unsigned integer codes packed into int32 words, a zero point per
group and output channel (packed the same way) and a 16-bit scale per group and output
channel; the weight is ``(code - zero) * scale`` in the scale's dtype (one rounding), the
input channels grouped by ``group_size`` (-1: one group) or, for act-order GPTQ
(``desc_act``), by the stored ``g_idx``. Activations stay 16-bit (W4A16 / W8A16). The
layouts differ:

- GPTQ: ``qweight`` [in * bits / 32, out], packed along the input channels; ``qzeros``
  [groups, out * bits / 32]; ``checkpoint_format`` ``gptq`` (v1, the default) stores each
  zero point minus one (its kernels add the one back), ``gptq_v2`` stores it as it is.
- AWQ (``version: gemm``): ``qweight`` [in, out * bits / 32] and ``qzeros``
  [groups, out * bits / 32], both packed along the output channels with the GEMM kernel's
  nibble order (int_packing.AWQ_ORDER); zero points as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import torch
from torch import nn

from specft.common.errors import SpecftError
from specft.quantized_checkpoints.base import (
    CHECKPOINT_FORMATS,
    CheckpointQuant,
    LayerQuant,
    QuantMethodFamily,
    need,
    read_tensors,
)
from specft.quantized_checkpoints.int_packing import (
    AWQ_ORDER,
    check_shape,
    group_index,
    unpack_int32,
)

PACKED = ("qweight", "qzeros", "scales", "g_idx")
BITS = (2, 4, 8)  # codes that tile an int32 word (3-bit GPTQ straddles words: not yet)


@dataclass
class PackedScheme:
    bits: int
    group_size: int  # -1: one group over all input channels
    sym: bool

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    def size(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def describe(self) -> str:
        where = "channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"int{self.bits} {where}" + ("" if self.sym else " asymmetric")


def dequantize(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """[out, in] weight from codes [in, out], zeros and scales [groups, out] and each input
    channel's group: ``(code - zero) * scale`` in the scale's dtype."""
    return ((codes - zeros[g_idx]).to(scales.dtype) * scales[g_idx]).t()


class PackedIntFamily(QuantMethodFamily):
    """What GPTQ and AWQ share: detection by quant_method, the scheme, the per-layer loop."""

    packs = True
    default_format = ""
    formats: tuple[str, ...] = ()
    format_key = ""  # the config key naming the layout

    def open(self, model_dir: Path) -> CheckpointQuant:
        qcfg = self.quantization_config(model_dir)
        layout = str(self.layout(qcfg) or self.default_format).lower()
        if layout not in self.formats:
            raise SpecftError(f"quant=checkpoint: {self.name} {self.format_key} {layout!r} is not supported yet; "
                              f"supported: {', '.join(self.formats)} (docs/checkpoints.md)")
        scheme = self.scheme(qcfg)
        if scheme.bits not in BITS:
            raise SpecftError(f"quant=checkpoint: {self.name} with {scheme.bits}-bit weights is not supported yet; "
                              f"supported: {', '.join(map(str, BITS))} bits")
        if scheme.group_size != -1 and scheme.group_size <= 0:
            raise SpecftError(f"quant=checkpoint: {self.name} group_size {scheme.group_size} is not a group size")
        ckpt = CheckpointQuant(self.name, model_dir, f"{self.name} {layout}: {scheme.describe()} weights"
                               f"{self.extra(qcfg)}, 16-bit inputs", list(qcfg.get("modules_to_not_convert") or []))
        ckpt.load_state = lambda model, dtype: self._load_state(ckpt, layout, scheme, model, dtype)
        return ckpt

    def layout(self, qcfg: dict) -> str | None:
        return qcfg.get(self.format_key)

    def scheme(self, qcfg: dict) -> PackedScheme:
        raise NotImplementedError

    def stored_bits(self, qcfg: dict, in_features: float) -> float | None:
        scheme = self.scheme(qcfg)
        group = in_features if scheme.group_size == -1 else scheme.group_size
        return scheme.bits + (16 + scheme.bits) / group  # a 16-bit scale and a packed zero point per group

    def extra(self, qcfg: dict) -> str:
        return ""

    def weight(self, local: dict[str, torch.Tensor], layout: str, scheme: PackedScheme, module: nn.Linear,
               name: str) -> torch.Tensor:
        raise NotImplementedError

    def _load_state(self, ckpt: CheckpointQuant, layout: str, scheme: PackedScheme, model: nn.Module,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
        raw = read_tensors(ckpt.model_dir, "model*.safetensors")
        state = {k: raw[k].to(dtype) for k in raw
                 if raw.dtype(k).is_floating_point and k.rsplit(".", 1)[-1] not in PACKED}
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or f"{name}.qweight" not in raw:
                continue
            if any(name == p or name.startswith(p + ".") or fnmatch(name, p) for p in ckpt.ignored):
                raise SpecftError(f"model.path: {name} is in modules_to_not_convert but its weight is packed")
            local = raw.under(name)
            stored = {k: v for k, v in local.items() if k in PACKED}
            ckpt.put_weight(state, name, module, stored,
                            lambda t, m=module, n=name: self.weight(t, layout, scheme, m, n), dtype)
            ckpt.layers[name] = LayerQuant(name, scheme.describe(), None)
        stray = sorted(k for k in raw if k.rsplit(".", 1)[-1] in PACKED and k.rsplit(".", 1)[0] not in ckpt.layers)
        if stray:  # its codes would be dropped and the layer left at its random initialization
            raise SpecftError(f"model.path: {stray[0]} belongs to no linear layer of the model")
        return state


class Gptq(PackedIntFamily):
    name, method = "gptq", "gptq"
    default_format, formats, format_key = "gptq", ("gptq", "gptq_v2"), "checkpoint_format"

    def layout(self, qcfg: dict) -> str | None:
        return qcfg.get("checkpoint_format") or qcfg.get("format")  # GPTQModel writes both; AutoGPTQ neither

    def scheme(self, qcfg: dict) -> PackedScheme:
        return PackedScheme(int(qcfg.get("bits", 4)), int(qcfg.get("group_size", 128)), bool(qcfg.get("sym", True)))

    def extra(self, qcfg: dict) -> str:
        return " act-order" if qcfg.get("desc_act") else ""

    def weight(self, local, layout, scheme, module, name):
        out, inp, per_word = module.out_features, module.in_features, 32 // scheme.bits
        groups = scheme.groups(inp)
        qweight, qzeros, scales = (need(local, k, name) for k in ("qweight", "qzeros", "scales"))
        check_shape(qweight, (inp // per_word, out), f"{name}.qweight", f"a [{out}, {inp}] int{scheme.bits} weight")
        check_shape(scales, (groups, out), f"{name}.scales", f"{groups} groups of {out} channels")
        check_shape(qzeros, (groups, out // per_word), f"{name}.qzeros", f"{groups} groups of {out} channels")
        codes = unpack_int32(qweight, scheme.bits, dim=0)
        zeros = unpack_int32(qzeros, scheme.bits, dim=1) + (1 if layout == "gptq" else 0)
        g_idx = group_index(local.get("g_idx"), inp, scheme.size(inp), f"{name}.g_idx")
        return dequantize(codes, zeros, scales, g_idx)


class Awq(PackedIntFamily):
    name, method = "awq", "awq"
    default_format, formats, format_key = "gemm", ("gemm",), "version"

    def scheme(self, qcfg: dict) -> PackedScheme:
        bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
        return PackedScheme(bits, int(qcfg.get("group_size", qcfg.get("q_group_size", 128))),
                            not bool(qcfg.get("zero_point", True)))

    def weight(self, local, layout, scheme, module, name):
        out, inp, per_word = module.out_features, module.in_features, 32 // scheme.bits
        groups = scheme.groups(inp)
        qweight, scales = need(local, "qweight", name), need(local, "scales", name)
        check_shape(qweight, (inp, out // per_word), f"{name}.qweight", f"a [{out}, {inp}] int{scheme.bits} weight")
        check_shape(scales, (groups, out), f"{name}.scales", f"{groups} groups of {out} channels")
        codes = self._unpack(qweight, scheme.bits)
        if scheme.sym and "qzeros" in local:  # vLLM's AWQ kernel would apply the stored ones
            raise SpecftError(f"quant=checkpoint: {name}.qzeros is stored, but the quantization_config says "
                              "zero_point: false; the config and the tensors disagree: set zero_point: true if the "
                              "zeros are the quantizer's, or drop the qzeros tensors")
        if scheme.sym:  # no zero points stored: the codes are centred on 2**(bits-1)
            zeros = torch.full((groups, out), 1 << (scheme.bits - 1), dtype=torch.int32)
        else:
            qzeros = need(local, "qzeros", name)
            check_shape(qzeros, (groups, out // per_word), f"{name}.qzeros", f"{groups} groups of {out} channels")
            zeros = self._unpack(qzeros, scheme.bits)
        return dequantize(codes, zeros, scales, group_index(None, inp, scheme.size(inp), name))

    @staticmethod
    def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
        if bits != 4:
            raise SpecftError(f"quant=checkpoint: AWQ GEMM with {bits}-bit weights is not supported yet; supported: 4")
        codes = unpack_int32(packed, bits, dim=1)
        # slot s of word w holds column 8w + AWQ_ORDER[s]
        slots = torch.arange(codes.shape[1])
        restored = torch.empty_like(codes)
        restored[:, slots // 8 * 8 + torch.tensor(AWQ_ORDER)[slots % 8]] = codes
        return restored


CHECKPOINT_FORMATS.register("gptq")(Gptq())
CHECKPOINT_FORMATS.register("awq")(Awq())
