"""Every quant config in conf/quant applied to the tiny Qwen3 models; static calibration,
KV-cache quantization, and straight-through QAT."""

import copy
import dataclasses

import pytest
import torch

from specft.common.errors import ConfigError
from specft.quant import TensorQuantSpec, apply_quant, calibrate, fake_quant, fake_quant_ste
from specft.target_model import load_target

from helpers import CONF, model_cfg, quant_cfg, root_cfg

# The emulated formats; quant=checkpoint reads a quantized checkpoint instead
# (tests/test_quantized_checkpoints.py).
QUANT_NAMES = sorted(p.stem for p in (CONF / "quant").glob("*.yaml") if p.stem != "checkpoint")


@pytest.fixture(scope="module")
def tiny():
    return {name: load_target(model_cfg(name))[0] for name in ("tiny_qwen3", "tiny_qwen3_moe")}


def test_all_issue_configs_exist():
    assert set(QUANT_NAMES) >= {"bf16", "fp8", "fp8_block", "mxfp4", "mxfp8", "nvfp4", "w4a16",
                                "w8a8_int8", "hif8"}


@pytest.mark.parametrize("model_name", ["tiny_qwen3", "tiny_qwen3_moe"])
@pytest.mark.parametrize("quant_name", QUANT_NAMES)
def test_config_validates_and_quantizes(tiny, model_name, quant_name):
    cfg = root_cfg(f"model={model_name}", f"quant={quant_name}")
    model = copy.deepcopy(tiny[model_name])
    ids = torch.randint(0, 500, (2, 10))
    ref = model(ids).logits
    report = apply_quant(model, cfg.quant)
    if cfg.quant.needs_calibration:
        calibrate(model, report, [{"input_ids": torch.randint(0, 500, (1, 12))}])
    out = model(ids).logits
    assert torch.isfinite(out).all()
    if quant_name == "bf16":
        assert torch.equal(out, ref) and not report.layers
    else:
        assert not torch.equal(out, ref)
        assert [r.name for r in report.kept] == ["lm_head"]
        errs = [r.weight_rel_mse for r in report.quantized if r.weight_rel_mse is not None]
        if cfg.quant.weight is not None:
            assert errs and all(0 < e < 0.2 for e in errs), errs


def test_static_scale_is_the_calibrated_amax(tiny):
    model = copy.deepcopy(tiny["tiny_qwen3"])
    report = apply_quant(model, quant_cfg("hif8"))
    seen = []
    proj = model.model.layers[2].mlp.down_proj
    proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].abs().amax().item()), prepend=True)
    batches = [{"input_ids": torch.randint(0, 500, (1, n))} for n in (5, 9, 7)]
    calibrate(model, report, batches)
    layer_index = [r.name for r in report.quantized].index("model.layers.2.mlp.down_proj")
    scale = report.quantizers[layer_index].scale
    assert scale.item() == pytest.approx(max(seen) / 32768.0, rel=1e-6)
    x = torch.randn(3, proj.in_features)
    hook_out = report.quantizers[layer_index](x)
    assert torch.equal(hook_out, fake_quant(x, report.quantizers[layer_index].spec, scale))


def test_kv_quant_changes_attention_and_is_consistent_with_a_kv_cache(tiny):
    kv_only = dataclasses.replace(quant_cfg("fp8_kv"), weight=None, activation=None)
    model = copy.deepcopy(tiny["tiny_qwen3"]).double()
    plain = copy.deepcopy(model)
    report = apply_quant(model, kv_only)
    assert report.kv_quantized
    ids = torch.randint(0, 500, (1, 12))
    full = model(ids).logits
    assert not torch.allclose(full, plain(ids).logits)
    # Incremental decoding re-quantizes cached keys; per-token scales are idempotent, so
    # the last position matches a full forward (float64: no summation-order noise).
    out = model(ids[:, :8], use_cache=True)
    past = out.past_key_values
    for t in range(8, 12):
        step = model(ids[:, t: t + 1], past_key_values=past, use_cache=True)
        past = step.past_key_values
        torch.testing.assert_close(step.logits[0, -1], full[0, t], rtol=1e-9, atol=1e-9)


def test_a_multi_token_step_on_a_kv_quantized_cache_stays_causal(tiny):
    """A speculative verify feeds k+1 tokens onto the cache at once. The KV transform runs
    as an attention function of its own name, which needs a mask function registered
    beside it: without one transformers builds no mask, and the step's tokens saw each
    other's future (logits 11 off on tiny Qwen3 in float64 before the fix)."""
    kv_only = dataclasses.replace(quant_cfg("fp8_kv"), weight=None, activation=None)
    model = copy.deepcopy(tiny["tiny_qwen3"]).double()
    apply_quant(model, kv_only)
    ids = torch.randint(0, 500, (1, 12))
    full = model(ids).logits
    past = model(ids[:, :8], use_cache=True).past_key_values
    verify = model(ids[:, 8:], past_key_values=past, use_cache=True)
    torch.testing.assert_close(verify.logits[0], full[0, 8:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("override, message", [
    ("quant.weight.scheme=mx quant.weight.format=int4", "MX blocks need e4m3, e5m2 or e2m1"),
    ("quant.weight.block_size=48", "quant.weight.block_size must divide hidden_size=64, got 48"),
    ("quant=nvfp4 quant.weight.format=e4m3", "nvfp4 uses e2m1 elements"),
    ("quant.activation.scheme=block", "block (B x B) scales are for weights"),
    ("quant.weight.symmetric=false", "asymmetric (zero point) needs int4 or int8"),
    ("quant.activation.dynamic=false", "static scales are per tensor"),
    ("quant.weight.scale_rule=nearest", "quant.weight.scale_rule: 'nearest' is not allowed"),
])
def test_bad_quant_values_are_one_clear_error(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        root_cfg("model=tiny_qwen3", *(["quant=mxfp4"] + override.split() if "quant=" not in override
                                       else override.split()))


def test_qat_toy_converges_with_mxfp4_weights():
    """A linear model trained through MXFP4 fake quantization (STE) from a small random
    start; rounding alone has zero gradient almost everywhere, so this needs the STE."""
    g = torch.Generator().manual_seed(0)
    spec = TensorQuantSpec("e2m1", "mx", 32, "floor")
    target = torch.randn(8, 64, generator=g)
    x = torch.randn(512, 64, generator=g)
    y = x @ target.T
    w = torch.nn.Parameter(torch.randn(8, 64, generator=g) * 0.1)
    opt = torch.optim.Adam([w], lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 600)
    losses = []
    for _ in range(600):
        loss = torch.nn.functional.mse_loss(x @ fake_quant_ste(w, spec).T, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0], (losses[0], losses[-1])


def test_nvfp4_two_level_scales():
    # One block of 16: amax 12 with tensor amax 12 -> tensor scale 12 / (448 * 6) and
    # block scale 12 / 6 / s_t = 448 exactly: elements are x / 2 on the E2M1 grid.
    x = torch.tensor([12.0, 5.0, -2.9, 0.6] + [0.0] * 12)
    q = fake_quant(x, TensorQuantSpec("e2m1", "nvfp4", 16))
    assert q[:4].tolist() == pytest.approx([12.0, 4.0, -3.0, 1.0])  # 0.6 / 2 -> 0.5


def test_asymmetric_int4_group_uses_the_full_range():
    x = torch.linspace(0.0, 15.0, 128)[None]  # all positive: symmetric wastes the sign
    sym = fake_quant(x, TensorQuantSpec("int4", "group", 128))
    asym = fake_quant(x, TensorQuantSpec("int4", "group", 128, symmetric=False))
    assert asym.unique().numel() == 16 and sym.unique().numel() == 8
    assert (asym - x).abs().max() <= 0.5 + 1e-6


def test_block_scales_are_per_tile():
    w = torch.ones(256, 256)
    w[:128, :128] *= 1000.0
    q = fake_quant(w, TensorQuantSpec("e4m3", "block", 128))
    assert torch.equal(q, w)  # each tile scaled by its own amax: 1 and 1000 both exact
    q1 = fake_quant(w, TensorQuantSpec("e4m3", "tensor"))
    assert not torch.equal(q1, w)  # one scale for all: 1 / (1000/448) is not on the grid


def test_ste_gradient_zero_only_where_clipped_for_static_scales():
    x = torch.tensor([1.0, 500.0, -3.0], requires_grad=True)
    spec = TensorQuantSpec("e4m3", "tensor", dynamic=False)
    fake_quant_ste(x, spec, torch.tensor(1.0)).sum().backward()
    assert x.grad.tolist() == [1.0, 0.0, 1.0]


def test_replace_keeps_spec_types():
    q = quant_cfg("mxfp4")
    assert dataclasses.replace(q, kv=None).weight.scheme == "mx"
