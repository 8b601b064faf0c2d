"""msModelSlim's own arithmetic as the oracle for specft's quant=checkpoint on its
"ascendV1" checkpoints. Runs in msModelSlim's venv (it pins its own packages), imports
nothing from specft, and writes, per checkpoint, ``oracle.safetensors`` beside it:

- ``input_ids`` of a few chat prompts, the model's hidden states after every decoder
  layer (``hidden.<i>``), the logits at the last 4 positions, and a greedy continuation
  (``greedy``);
- ``x`` (a random activation with outliers and a zero token) and ``x.<scheme>``: x
  quantized as each scheme's activations are.

The model is transformers' own, with every quantized Linear's forward replaced by the
scheme's arithmetic built from msModelSlim's QAL functions (calculate_qparam, quantize,
dequantize):

- W8A8_DYNAMIC: per-token INT8 qparams from each token's min/max, fake-quantized; the
  weight is its INT8 codes dequantized per channel.
  (msModelSlim's own W8A8DynamicPerChannelFakeQuantLinear reduces over dim 0, the token
  axis, which makes per-input-channel scales; vllm-ascend quantizes per token, as its
  name says, so the oracle does too.)
- W4A8_DYNAMIC: as W8A8_DYNAMIC, the weight's INT4 codes unpacked (and repacked by
  msModelSlim's packer to check) and dequantized per channel.
- W8A8: codes ``quantize(x)`` with the calibrated per-tensor scale and offset, then
  vllm-ascend's ``npu_quant_matmul``: ``deq_scale * (codes @ w.T + quant_bias)``, the
  integer sum exact (float64 here), the product with deq_scale in float32.

    /work/venv-msms/bin/python scripts/msmodelslim_oracle.py tests/fixtures/checkpoints/tiny_qwen3_msmodelslim/*
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from oracle_outputs import oracle_outputs
from safetensors.torch import load_file, save_file


def qal():
    from msmodelslim.ir.api import calculate_qparam, dequantize, quantize
    from msmodelslim.ir.qal.qbase import QDType, QParam, QScheme, QScope, QStorage

    return calculate_qparam, quantize, dequantize, QDType, QParam, QScheme, QScope, QStorage


def per_token_int8(x: torch.Tensor) -> torch.Tensor:
    calculate_qparam, quantize, dequantize, QDType, _, _, QScope, QStorage = qal()
    flat = x.reshape(-1, x.shape[-1])
    param = calculate_qparam(flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True), QDType.INT8,
                             QScope.PER_TOKEN, True)
    return dequantize(quantize(QStorage(QDType.FLOAT, flat.clone()), param), param).value.reshape(x.shape).to(x.dtype)


def static_codes(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    _, quantize, _, QDType, QParam, QScheme, QScope, QStorage = qal()
    param = QParam(scheme=QScheme(scope=QScope.PER_TENSOR, dtype=QDType.INT8, symmetric=False),
                   ext={"scale": scale.to(x.dtype), "offset": offset.to(x.dtype)})
    return quantize(QStorage(QDType.FLOAT, x.clone()), param).value.to(torch.float64)


def deq_scale(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).view(torch.float32) if t.dtype == torch.int64 else t.float()


def dynamic_forward(raw: dict, name: str):
    _, _, dequantize, QDType, QParam, QScheme, QScope, QStorage = qal()
    scale = raw[f"{name}.weight_scale"].float()
    param = QParam(scheme=QScheme(scope=QScope.PER_CHANNEL, dtype=QDType.INT8, symmetric=True),
                   ext={"scale": scale.reshape(-1), "offset": raw[f"{name}.weight_offset"].float().reshape(-1)})
    # the library's layout: per-channel parameters broadcast along the last dim of w.T
    weight = dequantize(QStorage(QDType.INT8, raw[f"{name}.weight"].T.clone()), param).value.T.float()

    def forward(x):
        return F.linear(per_token_int8(x), weight.to(x.dtype))
    return forward


def static_forward(raw: dict, name: str):
    w = raw[f"{name}.weight"].to(torch.float64)
    bias = raw[f"{name}.quant_bias"].to(torch.float64)
    deq = deq_scale(raw[f"{name}.deq_scale"]).to(torch.float64)
    scale, offset = raw[f"{name}.input_scale"].reshape(()), raw[f"{name}.input_offset"].reshape(())

    def forward(x):  # the integer sum is exact in float64; then float32 times deq_scale
        acc = (static_codes(x, scale, offset) @ w.T + bias).to(torch.float32)
        return (acc * deq.to(torch.float32)).to(x.dtype)
    return forward


def w4a8_forward(raw: dict, name: str):
    """INT4 codes unpacked with the inverse of msModelSlim's own packer (checked against it
    by repacking), dequantized by its QAL per channel."""
    from msmodelslim.format.common.pack import w4a8_pack_int4

    _, _, dequantize, QDType, QParam, QScheme, QScope, QStorage = qal()
    packed = raw[f"{name}.weight"]
    p = packed.t()
    codes = torch.stack((torch.bitwise_left_shift(p, 4) >> 4, p >> 4), dim=-1).reshape(p.shape[0], -1).t()
    assert torch.equal(w4a8_pack_int4(codes), packed), name
    param = QParam(scheme=QScheme(scope=QScope.PER_CHANNEL, dtype=QDType.INT4, symmetric=True),
                   ext={"scale": raw[f"{name}.weight_scale"].float().reshape(-1)})
    weight = dequantize(QStorage(QDType.INT4, codes.T.clone()), param).value.T.float()

    def forward(x):
        return F.linear(per_token_int8(x), weight.to(x.dtype))
    return forward


FORWARDS = {"W8A8_DYNAMIC": dynamic_forward, "W8A8": static_forward, "W4A8_DYNAMIC": w4a8_forward}


def oracle_model(model_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    desc = json.loads(next(model_dir.glob("quant_model_description*.json")).read_text())
    raw = {}
    for f in sorted(model_dir.glob("quant_model_weight*.safetensors")):
        raw.update(load_file(str(f)))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in raw.items() if desc.get(k) == "FLOAT"}, strict=False)
    model.tie_weights()
    for name, module in model.named_modules():
        scheme = desc.get(f"{name}.weight")
        if isinstance(module, torch.nn.Linear) and scheme in FORWARDS:
            module.forward = FORWARDS[scheme](raw, name)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir), desc


@torch.no_grad()
def write(model_dir: Path) -> None:
    model, tokenizer, desc = oracle_model(model_dir)
    out = oracle_outputs(model, tokenizer)
    torch.manual_seed(0)
    x = torch.randn(2, 9, 64) * torch.logspace(-3, 3, 64)
    x[1, 4] = 0
    out["x"] = x
    raw = load_file(str(next(model_dir.glob("quant_model_weight*.safetensors"))))
    layer = "model.layers.0.self_attn.q_proj"
    if desc.get(f"{layer}.weight") in ("W8A8_DYNAMIC", "W4A8_DYNAMIC"):
        out["x.per_token"] = per_token_int8(x)
    if desc.get(f"{layer}.weight") == "W8A8":
        out["x.W8A8"] = static_codes(x, raw[f"{layer}.input_scale"].reshape(()),
                                     raw[f"{layer}.input_offset"].reshape(())).float()
    save_file(out, str(model_dir / "oracle.safetensors"))
    print(f"{model_dir}: {desc.get('model_quant_type')}, {len(out)} tensors -> oracle.safetensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path)
    for d in parser.parse_args().dirs:
        if any(d.glob("quant_model_description*.json")):
            write(d)


if __name__ == "__main__":
    main()
