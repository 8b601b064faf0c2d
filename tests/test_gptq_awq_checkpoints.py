"""quant=checkpoint on GPTQ and AWQ checkpoints (Qwen's -GPTQ-Int4/-Int8 and -AWQ releases'
formats), against GPTQModel's own CPU kernels.

tests/fixtures/checkpoints/tiny_qwen3_gptq_awq/ was written on this CPU by the real tools
from specft's tiny Qwen3 (scripts/fixtures/make_gptq_awq_checkpoints.py, each in its own venv):
AutoRound 0.16's ``auto_gptq`` (GPTQ v1, symmetric) and ``auto_awq`` (AWQ GEMM, zero
points) exports, GPTQModel 7.7's GPTQ with act-order (``desc_act``, a shuffled ``g_idx``)
and of a tiny Qwen3-MoE, and AutoAWQ 0.2.9's AWQ GEMM. Each ``oracle.safetensors`` is
GPTQModel's (AutoAWQ's: its own ``dequantize_gemm``, weights only): every layer's weight as
its torch kernel dequantizes it, and its model's forward in float16 (its GPTQ torch kernel takes 16-bit
activations only). The weights must be bit-equal; the forward agrees to float16 rounding,
not bit for bit, since float16 GEMMs round by route (``F.linear`` and ``matmul`` of the same
operands already differ in the last bit on this CPU).
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specft.common.errors import SpecftError
from specft.quantized_checkpoints import open_checkpoint

from helpers import checkpoint_model, max_rel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "fixtures"))
from check_oracle_outputs import dense_weight  # noqa: E402 (per-expert weights out of the fused experts)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints" / "tiny_qwen3_gptq_awq"
CHECKPOINTS = ("gptq_autoround", "awq_autoround", "gptq_actorder", "gptq_moe")  # with GPTQModel's forward
WEIGHT_ORACLES = (*CHECKPOINTS, "awq_autoawq")  # AutoAWQ: its own dequantize_gemm, no forward
LAYERS = {"gptq_moe": 4 * 8 + 8 * 8 * 3}  # attention, and 8 experts x 3 projections, in 8 layers
FP16 = ("model.dtype=float16", "eval.dtype=float32")


def _qcfg(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())["quantization_config"]


def test_the_fixtures_were_made_by_the_tools():
    made = json.loads((FIXTURES / "made.json").read_text())
    assert made["tools"]["auto-round"]["auto-round"].startswith("0.16")
    assert made["tools"]["gptqmodel"]["gptqmodel"].startswith("7.7")
    assert made["tools"]["autoawq"]["autoawq"] == "0.2.9"  # it quantizes on this CPU too
    assert (_qcfg("gptq_autoround")["quant_method"], _qcfg("gptq_autoround")["sym"]) == ("gptq", True)
    assert (_qcfg("awq_autoround")["version"], _qcfg("awq_autoround")["zero_point"]) == ("gemm", True)
    assert _qcfg("gptq_actorder")["desc_act"] is True
    g_idx = load_file(str(FIXTURES / "gptq_actorder" / "model.safetensors"))["model.layers.0.mlp.down_proj.g_idx"]
    assert not torch.equal(g_idx.long(), torch.arange(128) // 32)  # act-order really shuffled the groups


@pytest.mark.parametrize("name", WEIGHT_ORACLES)
def test_weights_are_bit_equal_to_the_tools_dequantization(name):
    oracle = load_file(str(FIXTURES / name / "oracle.safetensors"))
    model, _, report = checkpoint_model(FIXTURES / name, *FP16)
    count = LAYERS.get(name, 56)
    assert report.checkpoint["family"] == _qcfg(name)["quant_method"] and len(report.checkpoint["layers"]) == count
    state = model.state_dict()
    layers = [k[len("dequantized."):] for k in oracle if k.startswith("dequantized.")]
    assert len(layers) == count
    for layer in layers:
        assert torch.equal(dense_weight(state, layer), oracle[f"dequantized.{layer}"]), layer


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_the_forward_agrees_with_gptqmodels_to_float16_rounding(name):
    oracle = load_file(str(FIXTURES / name / "oracle.safetensors"))
    model, tokenizer, _ = checkpoint_model(FIXTURES / name, *FP16)
    with torch.no_grad():
        out = model(oracle["input_ids"], output_hidden_states=True)
        first = model.generate(oracle["input_ids"], max_new_tokens=1, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id)
    for i, h in enumerate(out.hidden_states[1:]):
        assert max_rel(h, oracle[f"hidden.{i}"]) < 1e-2, i  # measured: at most 3.3e-3 (MoE: 6.6e-3)
    assert max_rel(out.logits[:, -oracle["logits"].shape[1]:], oracle["logits"]) < 5e-3
    width = oracle["input_ids"].shape[1]
    assert torch.equal(first[:, width], oracle["greedy"][:, width])


def _copy(tmp_path, name: str) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _edit_config(path: Path, **qcfg) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(qcfg)
    (path / "config.json").write_text(json.dumps(config))


def _weight(path: Path, layer: str) -> torch.Tensor:
    model, _, _ = checkpoint_model(path, *FP16)
    return model.state_dict()[f"{layer}.weight"]


def test_without_its_g_idx_an_act_order_checkpoint_would_not_match(tmp_path):
    """The check can fail: the same codes read in plain group order are far off."""
    layer = "model.layers.0.mlp.down_proj"
    plain = _copy(tmp_path, "gptq_actorder")
    _edit_tensors(plain, lambda t: [t.pop(k) for k in [k for k in t if k.endswith(".g_idx")]])
    oracle = load_file(str(FIXTURES / "gptq_actorder" / "oracle.safetensors"))[f"dequantized.{layer}"]
    assert max_rel(_weight(plain, layer), oracle) > 0.1


def test_gptq_v1_stores_its_zero_points_minus_one(tmp_path):
    """Read as gptq_v2 (zero points as they are), every weight moves by one scale."""
    layer = "model.layers.1.self_attn.o_proj"
    v2 = _copy(tmp_path, "gptq_autoround")
    _edit_config(v2, checkpoint_format="gptq_v2")
    oracle = load_file(str(FIXTURES / "gptq_autoround" / "oracle.safetensors"))[f"dequantized.{layer}"]
    assert max_rel(_weight(v2, layer), oracle) > 0.05


@pytest.mark.parametrize("name, edit, message", [
    ("gptq_autoround", {"checkpoint_format": "marlin"},
     "gptq checkpoint_format 'marlin' is not supported yet; supported: gptq, gptq_v2"),
    ("awq_autoround", {"version": "gemv_fast"}, "awq version 'gemv_fast' is not supported yet; supported: gemm"),
    ("gptq_autoround", {"bits": 3}, "gptq with 3-bit weights is not supported yet; supported: 2, 4, 8 bits"),
])
def test_an_unsupported_layout_is_one_line(tmp_path, name, edit, message):
    other = _copy(tmp_path, name)
    _edit_config(other, **edit)
    with pytest.raises(SpecftError, match=message):
        open_checkpoint(other)



def test_a_config_that_contradicts_its_tensors_is_refused_not_resolved(tmp_path):
    """zero_point: false beside stored qzeros (#63): read as symmetric, every zero point
    would be 8 and the stored ones ignored, where vLLM's AWQ kernel applies them."""
    contradicted = _copy(tmp_path, "awq_autoround")
    _edit_config(contradicted, zero_point=False)
    with pytest.raises(SpecftError, match=r"model.layers.0.self_attn.q_proj.qzeros is stored, but the "
                                          r"quantization_config says zero_point: false; the config and the tensors "
                                          r"disagree"):
        checkpoint_model(contradicted, *FP16)

def test_a_g_idx_that_is_not_a_permutation_of_the_groups_is_named(tmp_path):
    broken = _copy(tmp_path, "gptq_actorder")
    key = "model.layers.2.mlp.up_proj.g_idx"
    _edit_tensors(broken, lambda t: t[key].copy_(torch.zeros_like(t[key])))
    with pytest.raises(SpecftError, match=rf"{key} is not a permutation of 2 groups of 32 input channels"):
        checkpoint_model(broken, *FP16)


def test_scales_of_the_wrong_shape_are_named(tmp_path):
    broken = _copy(tmp_path, "awq_autoround")
    key = "model.layers.3.self_attn.q_proj.scales"
    _edit_tensors(broken, lambda t: t.update({key: t[key][:1].clone()}))
    with pytest.raises(SpecftError, match=rf"{key} has shape \[1, 64\], but 2 groups of 64 channels needs \[2, 64\]"):
        checkpoint_model(broken, *FP16)


def test_packed_tensors_of_no_layer_are_refused(tmp_path):
    broken = _copy(tmp_path, "gptq_autoround")
    _edit_tensors(broken, lambda t: t.update({"model.layers.0.mlp.extra_proj.qweight": torch.zeros(8, 8,
                                                                                                   dtype=torch.int32)}))
    with pytest.raises(SpecftError, match="model.layers.0.mlp.extra_proj.qweight belongs to no linear layer"):
        checkpoint_model(broken, *FP16)


def test_a_mixture_of_experts_checkpoint_fills_transformers_fused_experts():
    model, _, report = checkpoint_model(FIXTURES / "gptq_moe", *FP16)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 128, 64) and experts.down_proj.shape == (8, 64, 64)
    assert [r for r in report.layers if r.kind == "experts"][0].name == "model.layers.0.mlp.experts"


def test_an_expert_missing_from_a_layer_is_named(tmp_path):
    broken = _copy(tmp_path, "gptq_moe")
    prefix = "model.layers.5.mlp.experts.3.down_proj."
    _edit_tensors(broken, lambda t: [t.pop(k) for k in [k for k in t if k.startswith(prefix)]])
    with pytest.raises(SpecftError, match=r"model.layers.5.mlp.experts.3.down_proj.weight is missing from the "
                                          r"checkpoint \(its layer's other experts are there\)"):
        checkpoint_model(broken, *FP16)


def test_expert_inputs_quantized_with_static_or_differing_scales_are_refused():
    from specft.quantized_checkpoints.base import LayerQuant
    from specft.quantized_checkpoints.experts import expert_input_quantizers
    from specft.quantized_checkpoints.hf_fp8 import TokenGroupFp8Input
    from specft.quantized_checkpoints.modelopt import StaticFp8Input

    def layer(name, quantizer):
        return name, LayerQuant(name, "fp8", None if quantizer is None else "fp8 input", quantize_input=quantizer)

    dynamic = TokenGroupFp8Input(128)
    shared = dict(layer(f"m.experts.{e}.{p}", dynamic) for e in range(2) for p in ("gate_proj", "up_proj", "down_proj"))
    assert expert_input_quantizers("m.experts", shared) == (dynamic, dynamic)
    assert expert_input_quantizers("n.experts", shared) is None  # another layer's experts
    static = dict(shared, **dict([layer("m.experts.1.up_proj", StaticFp8Input(torch.tensor(0.1)))]))
    with pytest.raises(SpecftError, match=r"m.experts.1.up_proj quantizes the expert's input \(fp8 input\) "
                                          r"differently from its layer's other experts or with a static scale"):
        expert_input_quantizers("m.experts", static)
    partly = dict(shared, **dict([layer("m.experts.0.down_proj", None)]))
    with pytest.raises(SpecftError, match=r"m.experts.0.down_proj quantizes the expert's input \(16-bit\)"):
        expert_input_quantizers("m.experts", partly)


def test_packed_weights_of_a_mixture_of_experts_checkpoint_are_refused():
    with pytest.raises(SpecftError, match=r"model.checkpoint_weights=packed: Mixture-of-Experts checkpoints \(8 "
                                          r"experts\) load dense only for now"):
        checkpoint_model(FIXTURES / "gptq_moe", *FP16, "model.checkpoint_weights=packed")
