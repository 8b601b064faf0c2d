"""quant=checkpoint against the library that wrote the checkpoints.

The fixtures under tests/fixtures/checkpoints/tiny_qwen3/ were written by llm-compressor
0.14 (scripts/fixtures/make_checkpoints.py, its own venv) from specft's tiny Qwen3: FP8 per
channel / tensor / block, INT8 W8A8 after SmoothQuant + GPTQ with dynamic and static
activations, GPTQ W4A16 in groups of 32 with zero points, W8A16 groups. The oracle is
compressed-tensors (a test dependency; specft does not need it to run): its compressor's
decompression for weights, its fake_quantize for activations, and transformers' model
with it in the loop for the forward.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from test_bad_inputs import _run_unchanged

from specft.common.errors import SpecftError
from specft.quantized_checkpoints import open_checkpoint
from specft.quantized_checkpoints.compressed_tensors import (
    WEIGHT_FORMATS,
    CTArgs,
    dequantize_weight,
    input_quantizer,
)

from helpers import CONF, root_cfg

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints" / "tiny_qwen3"
CHECKPOINTS = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "checks"))
import check_checkpoints  # noqa: E402


def _qcfg(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())["quantization_config"]


def test_the_fixtures_cover_every_supported_format():
    # every format specft runs but naive-quantized (which llm-compressor 0.14 no longer writes)
    assert {_qcfg(n)["format"] for n in CHECKPOINTS} == set(WEIGHT_FORMATS) - {"naive-quantized"}
    made = json.loads((FIXTURES / "made.json").read_text())
    assert made["tool"]["llmcompressor"].startswith("0.14")


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_weights_are_bit_equal_to_the_librarys_own_dequantization(name):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qcfg = _qcfg(name)
    (group,) = qcfg["config_groups"].values()
    compressor = BaseCompressor.get_value_from_registry(qcfg["format"])
    raw = load_file(str(FIXTURES / name / "model.safetensors"))
    layers = sorted({k.rsplit(".", 1)[0] for k in raw if k.endswith(".weight_scale")})
    assert len(layers) == 56  # 8 layers x 7 Linear, lm_head ignored
    for prefix in layers:
        local = {k[len(prefix) + 1:]: v for k, v in raw.items() if k.startswith(prefix + ".")}
        ref = compressor.decompress(dict(local), QuantizationScheme(**group))["weight"]
        ours = dequantize_weight(local, CTArgs.parse(group["weights"], prefix), qcfg["format"], prefix)
        assert ours.dtype == ref.dtype and torch.equal(ours, ref), prefix


@pytest.mark.parametrize("name", [n for n in CHECKPOINTS if next(iter(_qcfg(n)["config_groups"].values()))
                                  .get("input_activations")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_quantization_is_bit_equal_to_the_librarys(name, dtype):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    (group,) = _qcfg(name)["config_groups"].values()
    args = QuantizationArgs(**group["input_activations"])
    raw = load_file(str(FIXTURES / name / "model.safetensors"))
    torch.manual_seed(0)
    x = (torch.randn(2, 9, 64) * torch.logspace(-3, 3, 64)).to(dtype)  # outliers, as activations have
    x[1, 4] = 0  # a token of zeros: the eps scale
    prefix = "model.layers.0.self_attn.q_proj."
    local = {k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)}
    glob = local.get("input_global_scale")  # NVFP4's calibrated scale over its dynamic group scales
    if args.dynamic:
        scale, zero = compute_dynamic_scales_and_zp(x, args, module=None, global_scale=glob)
    else:
        scale, zero = local["input_scale"].to(dtype), None
    ref = fake_quantize(x, scale, zero, args, global_scale=glob)
    ours = input_quantizer(CTArgs.parse(group["input_activations"], "inputs"), local, "q_proj")(x)
    assert ours.dtype == ref.dtype and torch.equal(ours, ref)
    assert not torch.equal(ours, x)  # it quantizes


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_hidden_states_logits_and_greedy_tokens_equal_the_librarys_forward(name):
    row = check_checkpoints.compare(FIXTURES / name, n_prompts=3, new_tokens=8)
    assert row["hidden_rel_err_max"] == 0.0 and row["logits_rel_err_max"] == 0.0, row
    assert row["greedy_identical"] == 3


def test_the_stage1_cache_of_a_checkpoint_holds_the_librarys_hidden_states(tmp_path):
    from specft.cache import CacheReader, ensure_cache

    name = "w8a8_int8_static_gptq"
    cfg = root_cfg("model=hf", f"model.path={FIXTURES / name}", "quant=checkpoint", "model.dtype=float32",
                   "data.num_samples=4", "cache.dtype=fp32", f"cache.dir={tmp_path / 'cache'}")
    assert cfg.model.name == name and cfg.model.num_layers == 8
    reader = CacheReader(ensure_cache(cfg))
    oracle, _ = check_checkpoints.oracle_model(FIXTURES / name)
    from specft.cache.info import describe

    text, _ = describe(reader.cache_dir)
    assert ("quant      checkpoint: compressed-tensors (int-quantized: int8 channel weights, int8 tensor inputs), "
            "56 layers quantized, ignored ['lm_head']") in text
    report = json.loads((reader.cache_dir / "quant_report.json").read_text())
    assert report["checkpoint"]["family"] == "compressed-tensors"
    assert report["checkpoint"]["layers"]["model.layers.0.mlp.down_proj"] == {
        "weight": "int8 channel", "activation": "int8 tensor"}
    for i in range(len(reader)):
        sample = reader[i]
        with torch.no_grad():
            out = oracle(sample["input_ids"][None], output_hidden_states=True)
        aux = torch.cat([out.hidden_states[j + 1][0] for j in reader.manifest["aux_layer_ids"]], dim=-1)
        assert torch.equal(sample["aux_hidden"], aux)
        assert torch.equal(sample["final_hidden"], out.hidden_states[-1][0])


def test_model_hf_reads_the_architecture_from_the_checkpoint():
    cfg = root_cfg("model=hf", f"model.path={FIXTURES / 'fp8_dynamic'}", "quant=checkpoint")
    tiny = OmegaConf.load(CONF / "model" / "tiny_qwen3.yaml")
    for key in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                "vocab_size", "tie_word_embeddings", "family"):
        assert getattr(cfg.model, key) == tiny[key], key
    assert (cfg.model.num_experts, cfg.model.experts_top_k) == (0, 0)
    wide = root_cfg("model=hf", f"model.path={FIXTURES / 'fp8_dynamic'}", "quant=checkpoint", "model.num_layers=9")
    assert wide.model.num_layers == 9  # a fact given on the command line wins (the loader then checks it)


# -- bad input ------------------------------------------------------------------------------

def _copy(tmp_path, name="fp8_dynamic") -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_an_emulated_format_on_a_quantized_checkpoint_is_refused(tmp_path):
    _run_unchanged(tmp_path, ["cache", "model=hf", f"model.path={FIXTURES / 'fp8_dynamic'}", "quant=fp8"],
                   "quant=fp8:", "already quantized (compressed-tensors)", "quant=checkpoint")


def test_quant_checkpoint_on_an_unquantized_model_is_refused(tmp_path):
    from specft.target_model.loader import MODEL_SOURCES

    plain, _ = MODEL_SOURCES.get("tiny")(root_cfg("model=tiny_qwen3").model)  # a 16-bit checkpoint directory
    _run_unchanged(tmp_path, ["cache", "model=hf", f"model.path={plain}", "quant=checkpoint"],
                   "quant=checkpoint:", "is not a quantized checkpoint")


@pytest.mark.parametrize("quant", ["bf16", "checkpoint"])
def test_a_quantized_checkpoint_that_lost_its_quantization_config_is_refused(tmp_path, quant):
    """Read as 16-bit, its FP8 codes would be the weights and every scale dropped, with
    only transformers' "UNEXPECTED" table as a warning, and a draft would train on it."""
    stripped = _copy(tmp_path)
    config = json.loads((stripped / "config.json").read_text())
    del config["quantization_config"]
    (stripped / "config.json").write_text(json.dumps(config))
    _run_unchanged(tmp_path, ["cache", "model=hf", f"model.path={stripped}", f"quant={quant}"],
                   "has no quantization_config, but its weights are quantized", "quant=checkpoint")


def test_an_unknown_quant_method_is_named_as_such(tmp_path):
    other = _copy(tmp_path)
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "squeezellm"}
    (other / "config.json").write_text(json.dumps(config))
    _run_unchanged(tmp_path, ["cache", "model=hf", f"model.path={other}", "quant=checkpoint"],
                   "quantization_config names quant_method 'squeezellm', which specft does not know; supported:")


def test_an_unsupported_format_is_named_with_the_supported_ones(tmp_path):
    other = _copy(tmp_path)
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq"}  # transformers' HQQ
    (other / "config.json").write_text(json.dumps(config))
    _run_unchanged(tmp_path, ["cache", "model=hf", f"model.path={other}", "quant=checkpoint"],
                   "is a hqq checkpoint, which specft cannot run yet",
                   "supported: awq, compressed-tensors, gguf, gpt-oss-mxfp4, gptq, hf-fp8")


def test_a_missing_scale_is_named(tmp_path):
    from specft.target_model import load_target

    broken = _copy(tmp_path)
    _edit_tensors(broken, lambda t: t.pop("model.layers.3.mlp.up_proj.weight_scale"))
    cfg = root_cfg("model=hf", f"model.path={broken}", "quant=checkpoint")
    # a layer whose scale is gone no longer looks quantized: its codes must not be read as weights
    with pytest.raises(SpecftError, match=r"model.layers.3.mlp.up_proj"):
        load_target(cfg.model)


def test_a_scale_of_the_wrong_shape_is_named(tmp_path):
    from specft.target_model import load_target

    broken = _copy(tmp_path)
    _edit_tensors(broken, lambda t: t.update({"model.layers.2.self_attn.o_proj.weight_scale": torch.ones(64)}))
    cfg = root_cfg("model=hf", f"model.path={broken}", "quant=checkpoint")
    with pytest.raises(SpecftError, match=r"model.layers.2.self_attn.o_proj.weight_scale has shape \[64\], but "
                                          r"fp8 channel scales of a \[64, 64\] weight have \[64, 1\]"):
        load_target(cfg.model)


def test_an_unsupported_scheme_inside_a_supported_format_is_one_line():
    with pytest.raises(SpecftError, match="int16"):
        CTArgs.parse({"num_bits": 16, "type": "int"}, "group_0.weights")
    assert open_checkpoint(FIXTURES / "fp8_dynamic").family == "compressed-tensors"


# -- the user's path: train, eval beside the 16-bit recipe's draft, export ------------------

def test_train_eval_and_export_against_a_checkpoint(tmp_path):
    from conftest import run_cli

    ckpt = FIXTURES / "w8a8_int8_sq_gptq"
    target = ["model=hf", f"model.path={ckpt}", "quant=checkpoint"]
    small = ["data.num_samples=8", "trainer.max_steps=2"]
    run_cli(["train", "model=tiny_qwen3", "quant=bf16", *small, "hydra.run.dir=runs/base"], cwd=tmp_path)
    run_cli(["train", *target, *small], cwd=tmp_path)
    ours = tmp_path / "runs" / "w8a8_int8_sq_gptq-checkpoint-eagle3-kl"
    assert json.loads((ours / "checkpoints" / "final" / "draft_config.json").read_text())["quant"] == "checkpoint"
    # the 16-bit recipe's draft (trained on tiny_qwen3) meets the checkpoint made from it
    run_cli(["eval", *target, f"eval.drafts=[{tmp_path / 'runs/base'},{ours}]", "eval.labels=[base,ours]",
             "eval.k=[2]", "eval.num_prompts=2", "eval.max_new_tokens=6", f"eval.out_dir={tmp_path / 'eval'}"],
            cwd=tmp_path)
    rows = json.loads((tmp_path / "eval" / "results.json").read_text())["results"]
    assert sorted(r["draft"] for r in rows) == ["base", "ours", "target alone"]
    run_cli(["export", str(ours), str(tmp_path / "export"), "--layout", "speculators"], cwd=tmp_path)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(ckpt)


def test_a_draft_of_another_width_is_still_refused_against_a_checkpoint():
    from specft.eval.runner import check_draft_matches_target

    cfg = root_cfg("model=hf", f"model.path={FIXTURES / 'fp8_dynamic'}", "quant=checkpoint")
    same = {"target_model": "tiny_qwen3", "target_hidden_size": 64, "aux_layer_ids": [1, 3, 4],
            "target_vocab_size": 2048}
    check_draft_matches_target(same, cfg, "base")  # named after the 16-bit model: allowed
    with pytest.raises(SpecftError, match="hidden size 576"):
        check_draft_matches_target({**same, "target_hidden_size": 576}, cfg, "other")


def test_a_checkpoint_requantized_in_place_gets_another_cache(tmp_path):
    """Same file names and sizes, other weights (here: the FP8 codes of every layer
    shifted by one step): the fingerprint samples the weight files' contents, so the old
    checkpoint's features are not reused."""
    from specft.target_model.loader import checkpoint_fingerprint

    path = _copy(tmp_path)
    cfg = root_cfg("model=hf", f"model.path={path}", "quant=checkpoint")
    before, size = checkpoint_fingerprint(cfg.model), (path / "model.safetensors").stat().st_size
    _edit_tensors(path, lambda t: t.update({k: (v.view(torch.uint8) ^ 1).view(v.dtype) for k, v in t.items()
                                            if v.dtype == torch.float8_e4m3fn}))
    assert (path / "model.safetensors").stat().st_size == size
    assert checkpoint_fingerprint(cfg.model) != before


def test_a_checkpoint_refused_after_its_ranks_start_leaves_nothing_behind(tmp_path):
    """A tensor missing is found when the checkpoint loads, after the run config and the
    cache folder were made: the refusal removes them (they held nothing else)."""
    broken = _copy(tmp_path)
    _edit_tensors(broken, lambda t: t.pop("model.layers.3.mlp.up_proj.weight_scale"))
    work = tmp_path / "work"
    work.mkdir()
    _run_unchanged(work, ["cache", "model=hf", f"model.path={broken}", "quant=checkpoint"],
                   "model.layers.3.mlp.up_proj.weight_scale is missing")
