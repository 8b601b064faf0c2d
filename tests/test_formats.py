"""Element formats and scaling against ml_dtypes (an independent oracle) and hand cases."""

import ml_dtypes
import numpy as np
import pytest
import torch

from specft.quant import TensorQuantSpec, fake_quant, fake_quant_ste, get_format
from specft.quant.fake_quant import mx_shared_exponent

ORACLES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
           "e2m1": ml_dtypes.float4_e2m1fn}


def _all_values(np_dtype):
    """Every finite value of a <=8-bit ml_dtypes format, from its bit patterns."""
    n = 16 if np_dtype == ml_dtypes.float4_e2m1fn else 256  # FP4 sits in a byte's low bits
    vals = np.arange(n, dtype=np.uint8).view(np_dtype).astype(np.float64)
    return vals[np.isfinite(vals)]


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_every_representable_value_round_trips(name):
    vals = torch.from_numpy(_all_values(ORACLES[name]))
    assert torch.equal(get_format(name).round(vals), vals)


@pytest.mark.parametrize("name", sorted(ORACLES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_values_match_ml_dtypes(name, dtype):
    fmt = get_format(name)
    g = torch.Generator().manual_seed(0)
    x = torch.cat([
        torch.randn(20000, generator=g, dtype=dtype) * fmt.max_value / 4,
        torch.rand(5000, generator=g, dtype=dtype) * 2 ** -8,  # subnormal territory
        torch.tensor([0.0, -0.0, fmt.max_value * 1.5, -fmt.max_value * 3, float("inf"),
                      float("-inf")], dtype=dtype),
    ])
    ours = fmt.round(x)
    clamped = x.clamp(-fmt.max_value, fmt.max_value).numpy()  # saturate, then cast
    oracle = torch.from_numpy(clamped.astype(ORACLES[name]).astype(np.float64)).to(dtype)
    assert torch.equal(ours, oracle)
    nan = fmt.round(torch.tensor([float("nan")], dtype=dtype))
    assert torch.isnan(nan).all()


def test_e8m0_scales_are_exact_powers_of_two():
    amax = torch.tensor([1.0, 1.5, 1.75, 6.0, 7.9, 0.01, 448.0])
    e2m1 = get_format("e2m1")
    # Hand-computed for E2M1 (emax 2, one mantissa bit, max 6):
    expected = {
        "floor": [-2, -2, -2, 0, 0, -9, 6],  # floor(log2 amax) - 2
        "ceil": [-2, -1, -1, 1, 1, -8, 7],  # ceil(log2 amax) - 2
        "even": [-2, -2, -1, 0, 1, -9, 7],  # amax to 1 mantissa bit (1.75 -> 2), then floor
        "rceil": [-2, -2, -1, 0, 1, -9, 7],  # ceil(log2(amax / 6))
    }
    for rule, want in expected.items():
        assert mx_shared_exponent(amax, e2m1, rule).tolist() == want, rule
    exp = mx_shared_exponent(amax, e2m1, "floor")
    for e in exp.tolist():
        assert float(np.float32(2.0 ** e).astype(ml_dtypes.float8_e8m0fnu)) == 2.0 ** e


def test_mxfp4_floor_rule_clips_large_mantissa():
    # amax 7.5 = 1.875 * 2^2: the floor rule picks scale 2^0, so 7.5 saturates to 6.
    x = torch.zeros(32)
    x[0], x[1], x[2] = 7.5, 2.4, -0.3
    q = fake_quant(x, TensorQuantSpec("e2m1", "mx", 32, "floor"))
    assert q[:3].tolist() == [6.0, 2.0, -0.5]
    # 1.4 * 2^2 = 5.6 has mantissa below 1.5: representable, rounds to 6 without clipping.
    x[0] = 5.6
    q = fake_quant(x, TensorQuantSpec("e2m1", "mx", 32, "floor"))
    assert q[0].item() == 6.0
    q = fake_quant(torch.full((32,), 7.5), TensorQuantSpec("e2m1", "mx", 32, "ceil"))
    assert q[0].item() == 8.0  # ceil scale 2^1: 3.75 -> 4 (ties to even) * 2


def test_mx_blocks_are_independent_along_last_dim():
    x = torch.ones(2, 64)
    x[0, 40] = 100.0  # only the second block of row 0 has a large value
    q = fake_quant(x, TensorQuantSpec("e2m1", "mx", 32, "floor"))
    assert torch.equal(q[0, :32], torch.ones(32))
    assert torch.equal(q[1], torch.ones(64))
    assert q[0, 41].item() == 0.0  # 1 / 2^4 scale -> 0.0625 rounds to 0 in E2M1


def test_per_channel_fp8_matches_manual_scaling():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    q = fake_quant(w, TensorQuantSpec("e4m3", "channel"))
    scale = w.abs().amax(-1, keepdim=True) / 448.0
    ref = torch.from_numpy((w / scale).numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float64)) * scale
    assert torch.equal(q, ref)
    assert torch.equal(q.abs().amax(-1), w.abs().amax(-1))  # amax maps to 448 exactly


def test_straight_through_gradient_with_dynamic_scales_is_identity():
    x = torch.tensor([[7.5, 2.4] + [0.1] * 30], requires_grad=True)
    q = fake_quant_ste(x, TensorQuantSpec("e2m1", "mx", 32, "floor"))
    assert q[0, 0].item() == 6.0  # the floor rule saturates the block max...
    q.sum().backward()
    assert torch.all(x.grad == 1.0)  # ...but the scale follows it, so its gradient passes


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_generic_rounding_matches_torch_native_cast(name):
    fmt = get_format(name)
    x = torch.randn(50000, generator=torch.Generator().manual_seed(2)) * fmt.max_value / 8
    assert torch.equal(fmt.round_generic(x), fmt.round(x))


def test_hif8_matches_en_dtypes_on_every_code_and_random_values():
    import en_dtypes

    hif8 = get_format("hif8")
    codes = np.arange(256, dtype=np.uint8).view(en_dtypes.hifloat8).astype(np.float64)
    finite = torch.from_numpy(codes[np.isfinite(codes)])
    assert torch.equal(hif8.round(finite), finite)
    assert finite.abs().max().item() == 32768.0 and finite[finite > 0].min().item() == 2.0 ** -22
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(100000, generator=g) * 100, torch.rand(50000, generator=g) * 2 ** -14,
                   torch.randn(50000, generator=g) * 3000,
                   torch.tensor([1.0625, -1.0625, 1.5 * 2 ** -17, 2.0 ** -23, 40000.0, 0.0])])
    oracle = x.clamp(-32768, 32768).numpy().astype(en_dtypes.hifloat8).astype(np.float32)
    assert torch.equal(hif8.round(x), torch.from_numpy(oracle))
    # Ties go away from zero: 1.0625 sits between 1.0 and 1.125 (3 mantissa bits).
    assert hif8.round(torch.tensor([1.0625, -1.0625])).tolist() == [1.125, -1.125]


def test_every_e8m0_scale_round_trips():
    """All 255 finite E8M0 values: the scale an MX block gets for amax = 2^e * 2^emax is
    exactly 2^e, and ml_dtypes' E8M0 encodes it without loss."""
    exps = torch.arange(-127, 128, dtype=torch.float64)
    oracle = np.arange(255, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    assert np.array_equal(oracle, np.exp2(exps.numpy()))
    amax = torch.exp2(exps + 2)  # E2M1's emax is 2
    got = mx_shared_exponent(amax, get_format("e2m1"), "floor")
    assert torch.equal(got.double(), exps.clamp(max=127))
    assert torch.equal(torch.exp2(got.double()), torch.from_numpy(oracle))


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1"])
def test_float32_bit_rounding_matches_ml_dtypes_on_every_midpoint(name):
    """round_float32 reads each binade's step from the exponent bits: check it on every
    representable value, every midpoint between neighbours (ties to even), values just
    either side of them, subnormals, saturation, signed zeros and NaN."""
    fmt = get_format(name)
    grid = torch.from_numpy(_all_values(ORACLES[name])).unique()
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1)]).float()
    x = torch.cat([grid.float(), near, torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    oracle = torch.from_numpy(x.numpy().astype(ORACLES[name]).astype(np.float32))
    ours = fmt.round_float32(x)
    assert torch.equal(ours, oracle)
    assert torch.equal(torch.signbit(ours), torch.signbit(oracle))
    # Past the largest value ml_dtypes overflows (NaN / Inf); ours saturates, as the formats do.
    big = fmt.round_float32(torch.tensor([fmt.max_value * 1.5, -1e30, float("inf"), float("-inf")]))
    assert big.tolist() == [fmt.max_value, -fmt.max_value, fmt.max_value, -fmt.max_value]
    assert torch.isnan(fmt.round_float32(torch.tensor([float("nan")]))).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme,fmt", [("token", "e4m3"), ("channel", "e4m3"), ("token", "e5m2"), ("token", "e2m1")])
@pytest.mark.parametrize("shape", [(64, 96), (3, 700, 400)], ids=["small", "prefill-sized"])
def test_rowwise_fast_path_equals_the_general_path(dtype, scheme, fmt, shape):
    """Per-row float formats take a fused float32 path (also for bfloat16 and float16
    inputs, computed in float32); the general path (taken when a clip mask is wanted)
    is the reference, bit for bit. A prefill-sized input goes through in pieces of rows
    (ROWWISE_CHUNK_ELEMENTS; 2,100 rows here, an uneven last piece)."""
    from specft.quant.fake_quant import (
        ROWWISE_CHUNK_ELEMENTS,
        TensorQuantSpec,
        fake_quant,
        quantize_with_clip_mask,
    )

    g = torch.Generator().manual_seed(3)
    rows = shape[0] if len(shape) == 2 else shape[0] * shape[1]
    scales = torch.logspace(-3, 3, rows).reshape(*shape[:-1], 1)
    x = (torch.randn(*shape, generator=g) * scales).to(dtype)
    x.view(-1, shape[-1])[5] = 0  # an all-zero row keeps scale 1
    assert (x.numel() > 2 * ROWWISE_CHUNK_ELEMENTS) == (len(shape) == 3)
    spec = TensorQuantSpec(format=fmt, scheme=scheme)
    fast = fake_quant(x, spec)
    general, _ = quantize_with_clip_mask(x, spec)
    assert fast.dtype == dtype
    assert torch.equal(fast, general)
