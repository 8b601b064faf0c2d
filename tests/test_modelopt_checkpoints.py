"""quant=checkpoint on NVIDIA ModelOpt's Hugging Face export, against ModelOpt's own
quantized model.

tests/fixtures/checkpoints/tiny_qwen3_modelopt/fp8 was written by ModelOpt 0.47 on this
CPU from specft's tiny Qwen3 (scripts/fixtures/make_modelopt_checkpoints.py, its own venv), with
``oracle.safetensors``: what ModelOpt's fake-quantized model computed before export.
ModelOpt fake-quantizes with ``448 / amax``; the export stores ``amax / 448``, which the
serving engine inverts: the two differ in the last bit of some scales, so the forward
agrees to float32 rounding, not bit for bit.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specft.common.errors import SpecftError
from specft.quantized_checkpoints import open_checkpoint

from helpers import checkpoint_model, max_rel, root_cfg

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoints" / "tiny_qwen3_modelopt" / "fp8"
NVFP4 = FIXTURE.parent / "nvfp4"
FP8_KV, NVFP4_KV = FIXTURE.parent / "fp8_kv", FIXTURE.parent / "nvfp4_kv"


def test_the_fixture_was_made_by_modelopt():
    made = json.loads((FIXTURE.parent / "made.json").read_text())
    assert made["tool"]["nvidia-modelopt"].startswith("0.47")
    assert json.loads((FIXTURE / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"


@pytest.mark.parametrize("fixture", [FIXTURE, FP8_KV], ids=["fp8", "fp8_kv"])
def test_hidden_states_logits_and_greedy_tokens_match_modelopts_model(fixture):
    """fp8_kv: ModelOpt's FP8 plus its FP8 KV cache (k/v_bmm_quantizers in the oracle's
    attention, k_scale / v_scale in the export); greedy decoding reads keys back from
    the cache, so the cached path is checked too."""
    oracle = load_file(str(fixture / "oracle.safetensors"))
    model, tokenizer, report = checkpoint_model(fixture)
    assert report.checkpoint["family"] == "modelopt" and len(report.checkpoint["layers"]) == 56
    with torch.no_grad():
        out = model(oracle["input_ids"], output_hidden_states=True)
        greedy = model.generate(oracle["input_ids"], max_new_tokens=oracle["greedy"].shape[1] -
                                oracle["input_ids"].shape[1], do_sample=False, pad_token_id=tokenizer.pad_token_id)
    for i, h in enumerate(out.hidden_states[1:]):
        assert max_rel(h, oracle[f"hidden.{i}"]) < 1e-6, i
    assert max_rel(out.logits[:, -oracle["logits"].shape[1]:], oracle["logits"]) < 1e-6
    assert torch.equal(greedy, oracle["greedy"])


def test_without_the_kv_cache_quantization_it_would_not_match():
    oracle = load_file(str(FP8_KV / "oracle.safetensors"))
    model, _, report = checkpoint_model(FP8_KV)
    assert report.checkpoint["attention"] == ["fp8 kv cache: per-layer static k_scale / v_scale"]
    model.specft_attention_transforms.clear()
    with torch.no_grad():
        out = model(oracle["input_ids"], output_hidden_states=True)
    assert max_rel(out.hidden_states[-1], oracle[f"hidden.{len(out.hidden_states) - 2}"]) > 1e-4


def test_nvfp4_with_an_fp8_kv_cache_reads_each_layers_scales():
    """NVFP4's forward has no CPU oracle; its KV cache is the FP8 one checked above, here
    with each layer's own scales from the export."""
    oracle = load_file(str(NVFP4_KV / "oracle.safetensors"))
    model, _, report = checkpoint_model(NVFP4_KV)
    assert report.checkpoint["summary"].endswith("fp8 kv cache")
    state = model.state_dict()
    assert all(torch.equal(state[f"{k[len('dequantized.'):]}.weight"], v) for k, v in oracle.items())
    (kv,) = model.specft_checkpoint.attention
    stored = load_file(str(NVFP4_KV / "model.safetensors"))
    for i in range(len(model.model.layers)):
        quant_k, quant_v = kv.quantizers[i]
        assert quant_k.scale == stored[f"model.layers.{i}.self_attn.k_proj.k_scale"]
        assert quant_v.scale == stored[f"model.layers.{i}.self_attn.v_proj.v_scale"]
    assert len({float(kv.quantizers[i][0].scale) for i in kv.quantizers}) > 1  # per layer, not one


def test_without_the_input_quantization_it_would_not_match():
    """The check can fail: the same weights with 16-bit inputs are far from ModelOpt's model."""
    from specft.target_model import load_target

    oracle = load_file(str(FIXTURE / "oracle.safetensors"))
    model, _ = load_target(root_cfg("model=hf", f"model.path={FIXTURE}", "quant=checkpoint",
                                    "model.dtype=float32").model)
    with torch.no_grad():
        out = model(oracle["input_ids"], output_hidden_states=True)
    assert max_rel(out.hidden_states[-1], oracle[f"hidden.{len(out.hidden_states) - 2}"]) > 1e-3


def _copy(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "fp8"))


def test_another_algorithm_is_named(tmp_path):
    other = _copy(tmp_path)
    config = json.loads((other / "hf_quant_config.json").read_text())
    config["quantization"]["quant_algo"] = "W4A8_AWQ"
    (other / "hf_quant_config.json").write_text(json.dumps(config))
    with pytest.raises(SpecftError, match="ModelOpt quant_algo W4A8_AWQ is not supported yet; supported: FP8, NVFP4"):
        open_checkpoint(other)



def test_an_export_without_its_hf_quant_config_is_told_which_file_is_missing(tmp_path):
    """Not "specft does not know modelopt" in a line that lists modelopt as supported (#63)."""
    from specft.quantized_checkpoints import check_unquantized

    other = _copy(tmp_path)
    (other / "hf_quant_config.json").unlink()
    assert json.loads((other / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    with pytest.raises(SpecftError, match=r"names quant_method 'modelopt', but the modelopt checkpoint's "
                                          r"hf_quant_config.json is missing; copy it from the quantizer's output"):
        check_unquantized(other)

def test_another_kv_cache_scheme_is_refused(tmp_path):
    other = _copy(tmp_path)
    config = json.loads((other / "hf_quant_config.json").read_text())
    config["quantization"]["kv_cache_quant_algo"] = "NVFP4"
    (other / "hf_quant_config.json").write_text(json.dumps(config))
    with pytest.raises(SpecftError, match="quantizes the KV cache as NVFP4, which specft cannot run from a checkpoint "
                                          "yet; supported: FP8"):
        open_checkpoint(other)


def test_a_missing_kv_scale_is_named(tmp_path):
    from specft.target_model import load_target

    broken = Path(shutil.copytree(FP8_KV, tmp_path / "fp8_kv"))
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.3.self_attn.v_proj.v_scale"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(SpecftError, match="model.layers.3.self_attn.v_proj.v_scale is missing"):
        load_target(root_cfg("model=hf", f"model.path={broken}", "quant=checkpoint").model)


def test_a_missing_input_scale_is_named(tmp_path):
    from specft.target_model import load_target

    broken = _copy(tmp_path)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.4.mlp.up_proj.input_scale"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(SpecftError, match="model.layers.4.mlp.up_proj.input_scale is missing"):
        load_target(root_cfg("model=hf", f"model.path={broken}", "quant=checkpoint").model)


# -- NVFP4: ModelOpt exports it on this CPU, but its quantized forward needs CUDA ("amax
# must be a CUDA tensor for dynamic block quantization"). Checked instead: the weights
# against ModelOpt's own NVFP4QTensor.dequantize (oracle.safetensors), and the inputs
# against compressed-tensors' NVFP4 input arithmetic with the global scale 1 / input_scale.

def test_nvfp4_weights_are_bit_equal_to_modelopts_dequantization():
    oracle = load_file(str(NVFP4 / "oracle.safetensors"))
    model, _, report = checkpoint_model(NVFP4)
    assert report.checkpoint["summary"].startswith("NVFP4: fp4 group 16 weights")
    assert len(report.checkpoint["layers"]) == 56
    state = model.state_dict()
    layers = [k[len("dequantized."):] for k in oracle]
    assert len(layers) == 56
    for layer in layers:
        assert torch.equal(state[f"{layer}.weight"], oracle[f"dequantized.{layer}"]), layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_inputs_are_compressed_tensors_nvfp4_under_the_inverted_input_scale(dtype):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from specft.quant.apply import apply_quant  # noqa: F401 (the model below installs the hooks)

    model, _, _ = checkpoint_model(NVFP4)
    layer = model.specft_checkpoint.layers["model.layers.2.mlp.down_proj"]
    input_scale = load_file(str(NVFP4 / "model.safetensors"))["model.layers.2.mlp.down_proj.input_scale"]
    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
                            dynamic="local", scale_dtype="torch.float8_e4m3fn")
    torch.manual_seed(0)
    x = (torch.randn(2, 9, 128) * torch.logspace(-2, 1, 128)).to(dtype)
    glob = (1 / input_scale).reshape(1)  # as compressed-tensors stores a global scale
    scale, zero = compute_dynamic_scales_and_zp(x, args, module=None, global_scale=glob)
    ref = fake_quantize(x, scale, zero, args, global_scale=glob)
    ours = layer.quantize_input(x)
    assert ours.dtype == ref.dtype and torch.equal(ours, ref)
    assert not torch.equal(ours, x)


def test_nvfp4_scales_of_the_wrong_shape_are_named(tmp_path):
    from specft.target_model import load_target

    broken = Path(shutil.copytree(NVFP4, tmp_path / "nvfp4"))
    tensors = load_file(str(broken / "model.safetensors"))
    key = "model.layers.1.self_attn.o_proj.weight_scale"
    tensors[key] = tensors[key][:, :2].contiguous()
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(SpecftError, match=r"model.layers.1.self_attn.o_proj.weight / weight_scale have shapes "
                                          r"\[64, 32\] / \[64, 2\], but an NVFP4 \[64, 64\] weight needs"):
        load_target(root_cfg("model=hf", f"model.path={broken}", "quant=checkpoint").model)
