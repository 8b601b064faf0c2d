"""quant=checkpoint on gpt-oss's own MXFP4 layout (``quant_method: mxfp4``), against
transformers' own reader of it.

tests/fixtures/checkpoints/tiny_gpt_oss_mxfp4 was written by scripts/fixtures/make_gpt_oss_fixture.py:
a gpt-oss model with random weights (transformers' GptOssConfig), its experts packed into
``*_blocks`` / ``*_scales`` as the released checkpoints are (no tool writes the layout on a
CPU). The oracle is transformers' ``Mxfp4Config(dequantize=True)``: its own unpacking and
scaling of the same bytes, and its own forward.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specft.common.errors import SpecftError

from helpers import checkpoint_model

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoints" / "tiny_gpt_oss_mxfp4"
BF16 = ("model.dtype=bfloat16",)


def _transformers_model(path: Path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                quantization_config=Mxfp4Config(dequantize=True)).eval()


def test_the_fixture_stores_the_experts_as_gpt_oss_does():
    config = json.loads((FIXTURE / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["quantization_config"]["quant_method"] == "mxfp4"
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    blocks, scales = tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"], \
        tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]
    assert blocks.dtype == scales.dtype == torch.uint8
    assert tuple(blocks.shape) == (4, 128, 2, 16) and tuple(scales.shape) == (4, 128, 2)
    assert not any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)


def test_every_tensor_and_the_forward_are_bit_equal_to_transformers_own_reading():
    oracle = _transformers_model(FIXTURE)
    model, _, report = checkpoint_model(FIXTURE, *BF16)
    assert report.checkpoint["family"] == "gpt-oss-mxfp4"
    assert sum(layer.kind == "experts" for layer in report.layers) == 8
    ours, theirs = model.state_dict(), oracle.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    ids = torch.arange(5, 60)[None]
    with torch.no_grad():
        a, b = model(ids, output_hidden_states=True), oracle(ids, output_hidden_states=True)
    assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states))
    assert torch.equal(a.logits, b.logits)


def _edit(tmp_path, edit) -> Path:
    broken = Path(shutil.copytree(FIXTURE, tmp_path / "gpt_oss"))
    tensors = load_file(str(broken / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(broken / "model.safetensors"))
    return broken


def test_the_nibble_order_matters(tmp_path):
    """The check can fail: codes read high nibble first are other weights."""
    key = "model.layers.2.mlp.experts.down_proj_blocks"
    swapped = _edit(tmp_path, lambda t: t.update({key: (t[key] << 4) | (t[key] >> 4)}))
    model, _, _ = checkpoint_model(swapped, *BF16)
    theirs = _transformers_model(FIXTURE).state_dict()
    assert not torch.equal(model.state_dict()["model.layers.2.mlp.experts.down_proj"],
                           theirs["model.layers.2.mlp.experts.down_proj"])


def test_scales_of_the_wrong_shape_are_named(tmp_path):
    key = "model.layers.1.mlp.experts.gate_up_proj_scales"
    broken = _edit(tmp_path, lambda t: t.update({key: t[key][:, :, :1].contiguous()}))
    with pytest.raises(SpecftError, match=r"model.layers.1.mlp.experts.gate_up_proj_blocks / "
                                          r"model.layers.1.mlp.experts.gate_up_proj_scales have shapes "
                                          r"\[4, 128, 2, 16\] / \[4, 128, 1\], but MXFP4 experts of shape "
                                          r"\[4, 64, 128\] need"):
        checkpoint_model(broken, *BF16)


def test_a_missing_scale_is_named(tmp_path):
    broken = _edit(tmp_path, lambda t: t.pop("model.layers.5.mlp.experts.down_proj_scales"))
    with pytest.raises(SpecftError, match="model.layers.5.mlp.experts.down_proj_scales is missing"):
        checkpoint_model(broken, *BF16)



def test_a_missing_block_tensor_is_named_not_called_stray(tmp_path):
    broken = _edit(tmp_path, lambda t: t.pop("model.layers.3.mlp.experts.gate_up_proj_blocks"))
    with pytest.raises(SpecftError, match=r"model.layers.3.mlp.experts.gate_up_proj_scales is stored without its "
                                          r"model.layers.3.mlp.experts.gate_up_proj_blocks; the checkpoint is "
                                          r"incomplete"):
        checkpoint_model(broken, *BF16)

def test_packed_and_partitioned_loads_are_refused_in_one_line(tmp_path):
    from test_bad_inputs import _run_unchanged

    for extra, message in ((["model.checkpoint_weights=packed"], "gpt-oss-mxfp4 checkpoints load dense only"),
                           (["cache.sharding=zero3", "trainer.nproc=2"], "gpt-oss-mxfp4 checkpoints load whole")):
        _run_unchanged(tmp_path, ["cache", "model=hf", f"model.path={FIXTURE}", "quant=checkpoint", *extra], message)
