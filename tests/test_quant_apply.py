"""Applying quant configs to real (tiny) Qwen3 and Qwen3-MoE models."""

import copy
import dataclasses

import pytest
import torch

from specft.quant import apply_quant, fake_quant
from specft.target_model import load_target

from helpers import model_cfg, quant_cfg


@pytest.fixture(scope="module")
def tiny_dense():
    return load_target(model_cfg("tiny_qwen3"))


@pytest.fixture(scope="module")
def tiny_moe():
    return load_target(model_cfg("tiny_qwen3_moe"))


def _apply(model, name):
    return apply_quant(model, quant_cfg(name))


def test_mxfp4_quantizes_every_linear_but_lm_head(tiny_dense):
    model = copy.deepcopy(tiny_dense[0])
    ref = copy.deepcopy(model)
    report = _apply(model, "mxfp4")
    spec = quant_cfg("mxfp4").weight
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {r.name for r in report.kept} == {"lm_head"}
    assert len(report.quantized) == len(linears) - 1
    for name, mod in linears.items():
        ref_w = dict(ref.named_modules())[name].weight
        if name == "lm_head":
            assert torch.equal(mod.weight, ref_w)
        else:
            assert not torch.equal(mod.weight, ref_w)
            assert torch.equal(fake_quant(mod.weight, spec), mod.weight)  # on the MX grid
    assert torch.equal(model.get_input_embeddings().weight, ref.get_input_embeddings().weight)


def test_activation_quant_runs_on_the_fly(tiny_dense):
    model = copy.deepcopy(tiny_dense[0])
    q = quant_cfg("fp8")
    apply_quant(model, dataclasses.replace(q, activation=None))
    weight_only = copy.deepcopy(model)
    apply_quant(model, dataclasses.replace(q, weight=None))
    ids = torch.randint(0, 500, (2, 12))
    seen = {}
    proj = model.model.layers[0].self_attn.q_proj
    proj.register_forward_hook(lambda m, a, o: seen.setdefault("x", a[0]))
    out = model(ids).logits
    x = seen["x"]
    # The hooked input is already FP8 per token: quantizing again is a no-op.
    assert torch.equal(fake_quant(x, q.activation), x)
    assert not torch.allclose(out, weight_only(ids).logits)


def test_moe_experts_are_quantized_and_router_is_kept(tiny_moe):
    model = copy.deepcopy(tiny_moe[0])
    ref = copy.deepcopy(model)
    report = _apply(model, "mxfp4")
    spec = quant_cfg("mxfp4").weight
    kinds = {r.name: r.kind for r in report.layers}
    experts = [n for n, k in kinds.items() if k == "experts"]
    assert len(experts) == model.config.num_hidden_layers
    for layer, ref_layer in zip(model.model.layers, ref.model.layers):
        e = layer.mlp.experts
        assert torch.equal(fake_quant(e.gate_up_proj, spec), e.gate_up_proj)
        assert torch.equal(fake_quant(e.down_proj, spec), e.down_proj)
        assert not torch.equal(e.down_proj, ref_layer.mlp.experts.down_proj)
        assert torch.equal(layer.mlp.gate.weight, ref_layer.mlp.gate.weight)


def test_moe_expert_inputs_see_activation_quant(tiny_moe):
    model = copy.deepcopy(tiny_moe[0])
    q = quant_cfg("mxfp4")
    apply_quant(model, q)
    experts = model.model.layers[0].mlp.experts
    h = torch.randn(5, model.config.hidden_size)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [0, 2]])
    w = torch.softmax(torch.randn(5, 2), -1)
    out = experts(h, idx, w)
    # Reference for token 0: experts 0 and 1, inputs quantized per token to FP8.
    ref = torch.zeros(model.config.hidden_size)
    for slot, e in enumerate(idx[0].tolist()):
        x = fake_quant(h[0:1], q.activation)
        gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, -1)
        mid = fake_quant(torch.nn.functional.silu(gate) * up, q.activation)
        ref += (torch.nn.functional.linear(mid, experts.down_proj[e]) * w[0, slot])[0]
    torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-6)
