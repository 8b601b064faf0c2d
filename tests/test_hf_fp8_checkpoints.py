"""quant=checkpoint on Hugging Face's fine-grained FP8 format (``quant_method: fp8``, Qwen's
own Qwen3-*-FP8 releases).

No tool writes it on a CPU, so tests/fixtures/checkpoints/tiny_qwen3_hf_fp8 is llm-compressor's
FP8_BLOCK fixture with its tensors renamed (scripts/fixtures/make_hf_fp8_fixture.py): the same codes
and block scales, HF's config. Two oracles, neither specft's: transformers' own
dequantization of the HF checkpoint (``FineGrainedFP8Config(dequantize=True)``, which runs
on CPU) for the weights, and compressed-tensors' forward of the source checkpoint for the
whole model with its dynamic FP8 group inputs (the same arithmetic as vLLM's
``per_token_group_quant_fp8`` in float32).
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_bad_inputs import _run_unchanged

from specft.common.errors import SpecftError
from specft.quantized_checkpoints import open_checkpoint

from helpers import checkpoint_model, max_rel, root_cfg

CHECKPOINTS = Path(__file__).resolve().parent / "fixtures" / "checkpoints"
FIXTURE = CHECKPOINTS / "tiny_qwen3_hf_fp8"
SOURCE = CHECKPOINTS / "tiny_qwen3" / "fp8_block"
# tiny Qwen3-MoE through llm-compressor's FP8_BLOCK (its experts linearized), renamed alike
MOE, MOE_SOURCE = CHECKPOINTS / "tiny_qwen3_moe_hf_fp8", CHECKPOINTS / "tiny_qwen3_moe" / "fp8_block"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "checks"))
import check_checkpoints  # noqa: E402


def test_the_fixture_is_the_fp8_block_checkpoint_renamed():
    qcfg = json.loads((FIXTURE / "config.json").read_text())["quantization_config"]
    assert qcfg == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [32, 32], "modules_to_not_convert": ["lm_head"]}
    ours, source = load_file(str(FIXTURE / "model.safetensors")), load_file(str(SOURCE / "model.safetensors"))
    renamed = {k.replace(".weight_scale_inv", ".weight_scale"): v for k, v in ours.items()}
    assert renamed.keys() == source.keys() and all(torch.equal(renamed[k], source[k]) for k in source)


def test_weights_are_bit_equal_to_transformers_own_dequantization():
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    oracle = AutoModelForCausalLM.from_pretrained(
        FIXTURE, dtype=torch.float32,
        quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=(32, 32)))
    model, _, report = checkpoint_model(FIXTURE)
    assert report.checkpoint["family"] == "hf-fp8" and len(report.checkpoint["layers"]) == 56
    theirs = oracle.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, theirs[name]), name


def test_hidden_states_logits_and_greedy_tokens_equal_compressed_tensors_forward():
    row = check_checkpoints.compare(FIXTURE, n_prompts=3, new_tokens=8, oracle_dir=SOURCE)
    assert row["hidden_rel_err_max"] == 0.0 and row["logits_rel_err_max"] == 0.0, row
    assert row["greedy_identical"] == 3
    assert row["summary"] == "fp8: e4m3 block 32x32 weights, fp8 token group 32 dynamic inputs"


def test_without_its_input_quantization_the_forward_would_not_match():
    """The check can fail: transformers' dequantized model (16-bit inputs) is off the oracle."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    plain = AutoModelForCausalLM.from_pretrained(
        FIXTURE, dtype=torch.float32,
        quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=(32, 32)))
    oracle, _ = check_checkpoints.oracle_model(SOURCE)
    ids = torch.tensor([list(range(5, 40))])
    with torch.no_grad():
        assert max_rel(plain(ids).logits, oracle(ids).logits) > 1e-3


# -- Mixture of Experts: Qwen3-235B-A22B-FP8 / Qwen3-30B-A3B-FP8 quantize every expert's
# inputs (FP8 per token in groups), which vLLM's fused MoE runs once per layer input and
# once per expert intermediate.

def test_moe_weights_are_bit_equal_to_transformers_own_dequantization_and_fusion():
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    oracle = AutoModelForCausalLM.from_pretrained(
        MOE, dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=(32, 32)))
    model, _, report = checkpoint_model(MOE)
    assert sum(layer.kind == "experts" for layer in report.layers) == 8
    theirs, ours = oracle.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys() and "model.layers.0.mlp.experts.gate_up_proj" in ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def _position_errors(model, oracle) -> list[torch.Tensor]:
    """Per decoder layer, each position's max relative error against the oracle."""
    with torch.no_grad():
        out = model(oracle["input_ids"], output_hidden_states=True)
    return [((h - oracle[f"hidden.{i}"]).abs().amax(-1) / oracle[f"hidden.{i}"].abs().amax(-1)).flatten()
            for i, h in enumerate(out.hidden_states[1:])]


@pytest.mark.parametrize("fixture", [MOE, MOE_SOURCE], ids=["hf_fp8", "compressed_tensors"])
def test_moe_expert_inputs_quantized_as_served_match_llm_compressors_model(fixture):
    """Oracle: llm-compressor's own quantized model in memory (its linearized experts, its
    FP8 fake quantization of every expert's input), oracle.safetensors. Stated tolerance:
    every layer's median position within 1e-6, and the first five layers' every position
    within 1e-5 (measured: 132 of 132 through layer 4 within 7.4e-7 on an AVX-512 machine,
    1.8e-6 on an AVX2-only one, whose float32 kernels sum in another order; from layer 5
    one position of one prompt, then 25 of its positions downstream, are off by ~1e-2: the
    fused loop sums in another order and a last-bit difference flips an FP8 code, as under
    TP); 2 of 3 greedy continuations identical. Without the experts' input quantization
    every position of every layer is off (median 0.036 to 0.23), so the check can fail."""
    oracle = load_file(str(fixture / "oracle.safetensors"))
    model, tokenizer, _ = checkpoint_model(fixture)
    errors = _position_errors(model, oracle)
    assert all(e.median() < 1e-6 for e in errors), [float(e.median()) for e in errors]
    assert all(e.max() < 1e-5 for e in errors[:5]), [float(e.max()) for e in errors]
    with torch.no_grad():
        new = oracle["greedy"].shape[1] - oracle["input_ids"].shape[1]
        greedy = model.generate(oracle["input_ids"], max_new_tokens=new, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
    assert (greedy == oracle["greedy"]).all(1).sum() >= 2
    for module in model.modules():  # the same model with its experts' inputs left in 16 bit
        if hasattr(module, "gate_up_proj"):
            module.__dict__.pop("forward", None)
    assert all(e.median() > 1e-2 for e in _position_errors(model, oracle))


def _copy(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "hf_fp8"))


def _edit_config(path: Path, **qcfg) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(qcfg)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit, message", [
    ({"activation_scheme": "static"}, "FP8 activation_scheme 'static' is not supported yet; supported: dynamic"),
    ({"fmt": "e5m2"}, "FP8 fmt 'e5m2' is not supported yet"),
    ({"weight_block_size": None}, "FP8 weight_block_size None is not supported"),
])
def test_an_unsupported_scheme_is_one_line(tmp_path, edit, message):
    other = _copy(tmp_path)
    _edit_config(other, **edit)
    with pytest.raises(SpecftError, match=message):
        open_checkpoint(other)


def test_an_unsupported_scheme_is_refused_before_anything_is_written(tmp_path):
    other = _copy(tmp_path)
    _edit_config(other, activation_scheme="static")
    _run_unchanged(tmp_path, ["cache", "model=hf", f"model.path={other}", "quant=checkpoint"],
                   "quant=checkpoint: FP8 activation_scheme 'static' is not supported yet")


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _load(path: Path):
    from specft.target_model import load_target

    return load_target(root_cfg("model=hf", f"model.path={path}", "quant=checkpoint").model)


def test_a_scale_of_the_wrong_shape_is_named(tmp_path):
    broken = _copy(tmp_path)
    _edit_tensors(broken, lambda t: t.update({"model.layers.2.mlp.down_proj.weight_scale_inv": torch.ones(2, 2)}))
    with pytest.raises(SpecftError, match=r"model.layers.2.mlp.down_proj.weight_scale_inv has shape \[2, 2\], but "
                                          r"32x32 blocks of a \[64, 128\] weight need \[2, 4\]"):
        _load(broken)


def test_a_missing_scale_is_named(tmp_path):
    broken = _copy(tmp_path)
    _edit_tensors(broken, lambda t: t.pop("model.layers.3.self_attn.q_proj.weight_scale_inv"))
    with pytest.raises(SpecftError, match="model.layers.3.self_attn.q_proj.weight_scale_inv is missing"):
        _load(broken)


def test_an_fp8_weight_in_modules_to_not_convert_is_refused(tmp_path):
    other = _copy(tmp_path)
    _edit_config(other, modules_to_not_convert=["lm_head", "model.layers.0.mlp"])
    with pytest.raises(SpecftError, match="model.layers.0.mlp.gate_proj is in modules_to_not_convert but its "
                                          "weight is FP8"):
        _load(other)

