"""Rotated targets (quant.rotation): the orthogonal matrices, the exactness of folding in
float64, and what quantization after a rotation does."""

import copy
import dataclasses
import json

import pytest
import scipy.linalg
import torch

from specft.cache import ensure_cache
from specft.common.errors import ConfigError
from specft.provenance.keys import cache_key
from specft.quant import apply_quant, fake_quant
from specft.quant.model_hooks import install_attention_transform
from specft.quant.orthogonal import orthogonal
from specft.quant.rotation import RotationSpec, rotate_model
from specft.target_model import load_target

from helpers import float64_target, model_cfg, quant_cfg, root_cfg


def test_power_of_two_hadamard_is_sylvester():
    assert torch.equal(orthogonal("hadamard", 64) * 8, torch.tensor(scipy.linalg.hadamard(64), dtype=torch.float64))


@pytest.mark.parametrize("n", [12, 20, 36, 576, 1536])  # Paley I / II bases; SmolLM2's hidden and MLP widths
def test_paley_orders_are_hadamard_matrices(n):
    h = orthogonal("hadamard", n) * n ** 0.5
    signs = h.round()
    assert torch.allclose(h, signs, atol=1e-12) and set(signs.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(signs @ signs.T, n * torch.eye(n, dtype=torch.float64))  # integer arithmetic: exact


def test_unknown_hadamard_order_and_kind_are_one_line():
    with pytest.raises(ConfigError, match="no Hadamard matrix of order 98"):
        orthogonal("hadamard", 98)
    with pytest.raises(ConfigError, match="unknown rotation kind 'givens'; allowed: hadamard, random"):
        orthogonal("givens", 8)


def test_random_orthogonal_is_seeded():
    a, b = orthogonal("random", 48, 1), orthogonal("random", 48, 2)
    assert torch.allclose(a @ a.T, torch.eye(48, dtype=torch.float64), atol=1e-13)
    assert torch.equal(a, orthogonal("random", 48, 1)) and not torch.allclose(a, b)


ALL = dict(residual="hadamard", head="hadamard", online_qk="hadamard", online_down="hadamard")
CASES = [("tiny_qwen3", ALL), ("tiny_qwen3", {k: "random" for k in ALL}),
         ("tiny_qwen3_moe", ALL)]


@pytest.mark.parametrize("name,kinds", CASES, ids=["dense-hadamard", "dense-random", "moe-hadamard"])
def test_rotated_model_in_float64_equals_the_original(name, kinds):
    model = float64_target(name)
    ids = torch.randint(0, 2000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    spec = RotationSpec(**kinds, seed=5)
    record = rotate_model(model, spec)
    with torch.no_grad():
        got = model(ids, output_hidden_states=True)
    assert set(record) == {k for k, v in kinds.items() if v}
    r1 = orthogonal(spec.residual, model.config.hidden_size, spec.seed)
    assert (got.logits - ref.logits).abs().max() < 1e-11
    # Every residual-stream state (embeddings, each layer's output) is the original @ R1.
    for mine, theirs in zip(got.hidden_states[:-1], ref.hidden_states[:-1]):
        assert (mine - theirs @ r1).abs().max() < 1e-11
        assert (mine - theirs).abs().max() > 0.1  # and it did rotate
    assert torch.equal(model.get_decoder().norm.weight, torch.ones_like(model.get_decoder().norm.weight))


def test_tied_embeddings_are_untied_before_folding():
    model = float64_target("tiny_qwen3")
    model.lm_head.weight = model.model.embed_tokens.weight  # tie, as SmolLM2 does
    ids = torch.randint(0, 2000, (1, 9))
    with torch.no_grad():
        ref = model(ids).logits
        rotate_model(model, RotationSpec())
        assert model.lm_head.weight is not model.model.embed_tokens.weight
        assert (model(ids).logits - ref).abs().max() < 1e-11


def test_quantizing_after_the_rotation_quantizes_the_rotated_weights_and_inputs():
    base, _ = load_target(model_cfg("tiny_qwen3"))
    cfg = quant_cfg("w8a8_int8_quarot")
    rotated = copy.deepcopy(base)
    rotate_model(rotated, cfg.rotation)
    model = copy.deepcopy(base)
    report = apply_quant(model, cfg)
    assert set(report.rotation) == {"residual", "head", "online_down"} and "rotated" in report.summary()
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj"):
        got, float_w = model.get_submodule(name).weight, rotated.get_submodule(name).weight
        assert torch.equal(got, fake_quant(float_w, cfg.weight))
    seen = {}
    down = model.model.layers[2].mlp.down_proj
    down.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    ids = torch.randint(0, 2000, (2, 10))
    logits = model(ids).logits
    assert torch.equal(fake_quant(seen["x"], cfg.activation), seen["x"])  # rotated first, then INT8 per token
    plain = copy.deepcopy(base)
    apply_quant(plain, quant_cfg("w8a8_int8"))
    assert not torch.allclose(logits, plain(ids).logits, atol=1e-3)


def test_rotation_tames_an_outlier_channel_for_int8_activations():
    """QuaRot's reason to exist: one massive residual channel ruins per-token INT8 scales; the
    rotation spreads it, so the rotated target's INT8 activations stay closer to the float
    model (weights left in float to isolate the activations; measured 0.030 vs 0.068)."""
    base, _ = load_target(model_cfg("tiny_qwen3"))
    with torch.no_grad():
        base.model.embed_tokens.weight[:, 7] *= 60.0
    ids = torch.randint(0, 2000, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = base(ids).logits
    errors = {}
    for name in ("w8a8_int8", "w8a8_int8_quarot"):
        model = copy.deepcopy(base)
        apply_quant(model, dataclasses.replace(quant_cfg(name), weight=None))
        with torch.no_grad():
            errors[name] = ((model(ids).logits - ref).norm() / ref.norm()).item()
    assert errors["w8a8_int8_quarot"] < 0.6 * errors["w8a8_int8"], errors


def test_attention_transforms_run_in_the_order_installed():
    model, _ = load_target(model_cfg("tiny_qwen3"))
    order = []
    install_attention_transform(model, lambda q, k, v: (order.append("rotate"), (q, k, v))[1])
    install_attention_transform(model, lambda q, k, v: (order.append("quantize"), (q, k, v))[1])
    model(torch.randint(0, 2000, (1, 5)))
    assert order[:2] == ["rotate", "quantize"] and len(order) == 2 * model.config.num_hidden_layers


def test_rotation_joins_the_cache_key_only_when_set():
    plain, rotated = quant_cfg("w8a8_int8"), quant_cfg("w8a8_int8_quarot")
    assert "rotation" not in cache_key(plain)
    assert cache_key(rotated)["rotation"]["residual"] == "hadamard"
    assert cache_key(dataclasses.replace(rotated, rotation=dataclasses.replace(rotated.rotation, seed=1))) \
        != cache_key(rotated)


def test_cache_of_a_rotated_target_holds_rotated_states(tmp_path):
    """Stage 1 end to end: the cached aux states are the rotated target's (its quant report
    names the rotations), and the embedding the draft will read is rotated too."""
    cfg = root_cfg("model=tiny_qwen3", "quant=w8a8_int8_quarot", "data.num_samples=4", "cache.dtype=fp32",
                   f"cache.root={tmp_path / 'cache'}")
    cache_dir = ensure_cache(cfg)
    report = json.loads((cache_dir / "quant_report.json").read_text())
    assert report["rotation"]["residual"] == {"kind": "hadamard", "size": 64, "seed": 0}
    from specft.cache import CacheReader

    base, _ = load_target(cfg.model)
    r1 = orthogonal("hadamard", 64).float()
    emb = CacheReader(cache_dir).target_embedding()
    torch.testing.assert_close(emb, base.model.embed_tokens.weight.detach() @ r1, rtol=1e-5, atol=1e-6)
    from specft.cache.info import describe

    assert "rotated: residual hadamard, head hadamard, online_down hadamard" in describe(cache_dir)[0]
