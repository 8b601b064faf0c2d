"""model.checkpoint_weights=packed: a quantized checkpoint's layers kept at their stored
width (PackedLinear) and dequantized one at a time in the forward. The numbers must be the
dense load's, bit for bit (the cache key does not tell the two apart), in less memory."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specft.common.errors import SpecftError
from specft.quantized_checkpoints.base import PackedLinear

from helpers import checkpoint_model, root_cfg

CHECKPOINTS = Path(__file__).resolve().parent / "fixtures" / "checkpoints"
FP16 = ("model.dtype=float16", "eval.dtype=float32")
CASES = [  # (checkpoint, overrides): every family that packs, and its layouts
    ("tiny_qwen3_gptq_awq/gptq_actorder", FP16), ("tiny_qwen3_gptq_awq/awq_autoround", FP16),
    ("tiny_qwen3_hf_fp8", ()), ("tiny_qwen3/w4a16_g32_gptq", ()), ("tiny_qwen3/nvfp4", ()),
    ("tiny_qwen3/w8a8_int8_static_gptq", ()), ("tiny_qwen3_modelopt/fp8", ()), ("tiny_qwen3_modelopt/nvfp4", ()),
]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name, extra", CASES)
def test_packed_weights_compute_the_dense_numbers_in_less_memory(name, extra):
    dense, tokenizer, _ = checkpoint_model(CHECKPOINTS / name, *extra)
    packed, _, report = checkpoint_model(CHECKPOINTS / name, *extra, "model.checkpoint_weights=packed")
    layers = {n: m for n, m in packed.named_modules() if isinstance(m, PackedLinear)}
    assert len(layers) == len(report.checkpoint["layers"]) == 56
    ids = torch.tensor([list(range(5, 45)), list(range(100, 140))])
    with torch.no_grad():
        a, b = dense(ids, output_hidden_states=True), packed(ids, output_hidden_states=True)
        ga = dense.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        gb = packed.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states))
    assert torch.equal(a.logits, b.logits) and torch.equal(ga, gb)
    dense_weights = _bytes(dense.get_submodule(n).weight for n in layers)
    stored = _bytes(t for m in layers.values() for t in m.buffers())
    assert stored < 0.6 * dense_weights  # 4- and 8-bit codes against 16- and 32-bit weights
    assert not any(p.is_meta for p in packed.parameters())


def test_the_cache_of_a_packed_target_is_the_dense_ones(tmp_path):
    from specft.cache import CacheReader, ensure_cache

    path = CHECKPOINTS / "tiny_qwen3_hf_fp8"
    common = ("model=hf", f"model.path={path}", "quant=checkpoint", "model.dtype=float32", "data.num_samples=3",
              "cache.dtype=fp32")
    dense = CacheReader(ensure_cache(root_cfg(*common, f"cache.dir={tmp_path / 'dense'}")))
    packed = CacheReader(ensure_cache(root_cfg(*common, "model.checkpoint_weights=packed",
                                               f"cache.dir={tmp_path / 'packed'}")))
    assert len(dense) == len(packed) == 3
    for i in range(3):
        for key in ("input_ids", "aux_hidden", "final_hidden"):
            assert torch.equal(dense[i][key], packed[i][key]), (i, key)


def test_packed_weights_need_a_checkpoint():
    with pytest.raises(SpecftError, match="model.checkpoint_weights=packed keeps a quantized checkpoint's layers "
                                          "as stored; quant=mxfp4 emulates"):
        root_cfg("model=tiny_qwen3", "quant=mxfp4", "model.checkpoint_weights=packed")


def test_a_family_that_loads_dense_only_is_named():
    with pytest.raises(SpecftError, match="model.checkpoint_weights=packed: msmodelslim checkpoints load dense only "
                                          "for now; packed: awq, compressed-tensors, gptq, hf-fp8, modelopt"):
        checkpoint_model(CHECKPOINTS / "tiny_qwen3_msmodelslim" / "w8a8_dynamic", "model.checkpoint_weights=packed")


def test_a_bad_tensor_is_refused_at_load_not_at_the_first_forward(tmp_path):
    broken = Path(shutil.copytree(CHECKPOINTS / "tiny_qwen3_gptq_awq" / "gptq_actorder", tmp_path / "g"))
    tensors = load_file(str(broken / "model.safetensors"))
    key = "model.layers.2.mlp.up_proj.g_idx"
    tensors[key] = torch.zeros_like(tensors[key])
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(SpecftError, match=f"{key} is not a permutation"):
        checkpoint_model(broken, *FP16, "model.checkpoint_weights=packed")
