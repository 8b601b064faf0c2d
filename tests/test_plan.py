"""`specft plan`: per-rank memory against arithmetic done by hand in the test."""

import re

import pytest

from specft.commands.plan import plan_rows

from conftest import run_cli
from helpers import root_cfg

GB = 1e9


def _rows(model, quant, *extra):
    cfg = root_cfg(f"model={model}", f"quant={quant}", *extra)
    tokens = cfg.cache.batch_size * cfg.data.max_seq_len
    return cfg, plan_rows(cfg.model, cfg.quant, cfg.plan, tokens, 4 * cfg.model.hidden_size * 2 + 9)


def test_qwen3_235b_mxfp4_weights_by_hand():
    cfg, rows = _rows("qwen3_235b_a22b", "mxfp4")
    h, layers, e, i, v = 4096, 94, 128, 1536, 151936
    attn = h * 64 * 128 * 2 + h * 4 * 128 * 2  # q, o; k, v
    linear = layers * (attn + e * 3 * h * i)
    other = 2 * v * h + layers * (h * e + 2 * h + 2 * 128) + h  # embed, head, router, norms
    assert linear + other == pytest.approx(235.1e9, rel=1e-3)  # the model's name, checked
    quantized = linear * (4 + 8 / 32) / 8  # E2M1 + one E8M0 byte per 32
    shard = (quantized + 2 * other) / 8
    gather = 2 * 2 * (attn + e * 3 * h * i + h * e + 2 * h + 2 * 128) * (4.25 / 16)
    assert rows[0]["devices"] == 8
    assert rows[0]["weights_gb"] == pytest.approx((shard + gather) / GB, rel=1e-9)
    assert (quantized + 2 * other) / GB == pytest.approx(126.8, abs=0.1)  # "about 120 GB in MXFP4"
    assert [r["weights_gb"] for r in rows] == sorted((r["weights_gb"] for r in rows), reverse=True)
    # Stage 1 runs without logits: active params are attention, 8 of 128 experts, router.
    active = layers * (attn + 8 * 3 * h * i + h * e)
    assert rows[0]["tokens_per_s_per_rank"] == pytest.approx(300e12 * 0.4 / (2 * active))


def test_qwen2_5_72b_fp8_tensor_parallel_by_hand():
    cfg, rows = _rows("qwen2_5_72b", "fp8", "plan.strategy=tp", "plan.devices=[8,16,32]")
    h, layers, i, v = 8192, 80, 29568, 152064
    attn = h * 64 * 128 * 2 + h * 8 * 128 * 2
    linear = layers * (attn + 3 * h * i)
    in_mean = (5 * h + i) / 6
    quantized = linear * (8 + 32 / in_mean) / 8  # E4M3 + an fp32 scale per output channel
    other = 2 * v * h + layers * 2 * h + h
    for r in rows:
        assert r["weights_gb"] == pytest.approx((quantized / r["devices"] + 2 * other) / GB, rel=1e-9)
    kv = cfg.cache.batch_size * cfg.data.max_seq_len * layers * 2 * 8 * 128 * 2
    assert rows[0]["kv_gb"] == 0.0  # capture runs without a KV cache unless asked
    _, with_kv = _rows("qwen2_5_72b", "fp8", "plan.strategy=tp", "plan.with_kv=true", "plan.devices=[8]")
    assert with_kv[0]["kv_gb"] == pytest.approx(kv / 8 / GB)


def test_plan_refuses_what_does_not_fit(tmp_path):
    ok = run_cli(["plan", "model=qwen3_235b_a22b", "quant=mxfp4", "plan.devices=[8,16,32]"], cwd=tmp_path)
    assert "qwen3_235b_a22b / mxfp4" in ok.stdout and ok.stdout.count(" yes ") == 3
    bad = run_cli(["plan", "model=qwen2_5_72b", "quant=bf16", "plan.devices=[1]"], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: plan: qwen2_5_72b / bf16 does not fit")
    assert not (tmp_path / "runs").exists()  # arithmetic only: nothing written


def test_cache_or_online_by_hand(tmp_path):
    from specft.commands.plan import cache_or_online_rows

    cfg = root_cfg("model=qwen3_32b", "quant=mxfp4", "plan.samples=[30000]", "plan.tokens_per_sample=2048",
                   "trainer.micro_batch_size=2", "trainer.grad_accum=4")
    h = 5120
    per_token = 4 * h * 2 + 9  # 3 aux layers + final in bf16, token id and mask
    tok_s = 1000.0
    (row,) = cache_or_online_rows(cfg, per_token, tok_s)
    assert row["cache_tb"] == pytest.approx(30000 * 2048 * per_token / 1e12)
    assert row["cache_tb"] == pytest.approx(2.52, abs=0.01)  # SpecForge #426's order: TBs for 30k samples
    assert row["target_pass_device_hours"] == pytest.approx(30000 * 2048 / 1000 / 3600)
    assert row["online_s_per_step_per_rank"] == pytest.approx(2 * 4 * 2048 / 1000)
    out = run_cli(["plan", "model=qwen3_32b", "quant=mxfp4", "plan.samples=[30000]"], cwd=tmp_path)
    assert "cache or online" in out.stdout and "30000" in out.stdout


# Released checkpoints' quantization_config, as their config.json writes it.
QWEN_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
QWEN_AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True,
            "modules_to_not_convert": None}


def _checkpoint_config(tmp_path, name: str, model: str, qcfg: dict):
    """A folder holding only the config.json of ``model`` (a named config) with ``qcfg``."""
    import json

    from transformers import Qwen3Config, Qwen3MoeConfig

    m = root_cfg(f"model={model}").model
    arch = dict(hidden_size=m.hidden_size, num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, vocab_size=m.vocab_size,
                tie_word_embeddings=False)
    if m.num_experts:
        config = Qwen3MoeConfig(**arch, moe_intermediate_size=m.intermediate_size, num_experts=m.num_experts,
                                num_experts_per_tok=m.experts_top_k).to_dict()
    else:
        config = Qwen3Config(**arch, intermediate_size=m.intermediate_size).to_dict()
    config["quantization_config"] = qcfg
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name, model, qcfg, bits, stored_gb", [
    ("Qwen3-32B-FP8", "qwen3_32b", QWEN_FP8, 8 + 32 / (128 * 128), 34.3),
    ("Qwen3-32B-AWQ", "qwen3_32b", QWEN_AWQ, 4 + (16 + 4) / 128, 19.3),
    ("Qwen3-235B-A22B-FP8", "qwen3_235b_a22b", QWEN_FP8, 8 + 32 / (128 * 128), 236.4),
])
def test_a_checkpoint_is_sized_as_stored_beside_what_specft_holds(tmp_path, name, model, qcfg, bits, stored_gb):
    m = root_cfg(f"model={model}").model
    h, hd, layers, v = m.hidden_size, m.head_dim, m.num_layers, m.vocab_size
    e = m.num_experts or 1
    linear = layers * (h * m.num_heads * hd * 2 + h * m.num_kv_heads * hd * 2 + e * 3 * h * m.intermediate_size)
    other = 2 * v * h + layers * ((h * e if m.num_experts else 0) + 2 * h + 2 * hd) + h
    assert (linear * bits / 8 + 2 * other) / GB == pytest.approx(stored_gb, abs=0.05)
    path = _checkpoint_config(tmp_path, name, model, qcfg)
    proc = run_cli(["plan", "model=hf", f"model.path={path}", "quant=checkpoint", "plan.device_memory_gb=1000"],
                   cwd=tmp_path)
    assert f"checkpoint: {stored_gb:.1f} GB as stored (checkpoint {qcfg['quant_method'].replace('fp8', 'hf-fp8')}, " \
           f"{bits:.2f} bits per weight as stored" in proc.stdout
    # dense: dequantized on load, partitioned under zero3 (the default plan.strategy) as the
    # 16-bit target is, whole on every rank otherwise; packed: as stored, plus one dense Linear
    bf16 = run_cli(["plan", f"model={model}", "quant=bf16", "plan.device_memory_gb=1000"], cwd=tmp_path)
    assert rows_of(proc.stdout) and [r[1] for r in rows_of(proc.stdout)] == [r[1] for r in rows_of(bf16.stdout)]
    assert "dequantized on load (model.checkpoint_weights=dense), partitioned over the ranks" in proc.stdout
    whole = f"{(linear + other) * 2 / GB:.1f}G"
    tp = run_cli(["plan", "model=hf", f"model.path={path}", "quant=checkpoint", "plan.device_memory_gb=1000",
                  "plan.strategy=tp"], cwd=tmp_path)
    assert rows_of(tp.stdout) and all(r[1] == whole for r in rows_of(tp.stdout))
    packed = run_cli(["plan", "model=hf", f"model.path={path}", "quant=checkpoint", "plan.device_memory_gb=1000",
                      "model.checkpoint_weights=packed"], cwd=tmp_path)
    in_flight = 2 * max(h * m.intermediate_size, h * m.num_heads * hd)
    held = f"{(linear * bits / 8 + 2 * other + in_flight) / GB:.1f}G"
    assert rows_of(packed.stdout) and all(r[1] == held for r in rows_of(packed.stdout))


def rows_of(stdout: str) -> list[list[str]]:
    """The plan's per-device-count rows."""
    return [r for r in map(str.split, stdout.splitlines()) if len(r) == 8 and r[0].isdigit()]


@pytest.mark.parametrize("override, message", [
    ("plan.headroom=3", r"plan.headroom: a share of the device, in \(0, 1\]; got 3"),
    ("plan.mfu=0", r"plan.mfu: a share of the device, in \(0, 1\]; got 0"),
    ("plan.devices=[]", "plan.devices: give at least one device count"),
    ("plan.device_memory_gb=0", "plan.device_memory_gb: must be > 0"),
    ("plan.device_tflops=-1", "plan.device_tflops: must be > 0"),
])
def test_plan_settings_that_would_lie_or_crash_are_one_line(tmp_path, override, message):
    """A headroom past 1 let a 130 GB rank "fit" a 64 GB device; empty devices and mfu=0
    ended in IndexError / ZeroDivisionError."""
    proc = run_cli(["plan", "model=qwen3_235b_a22b", "quant=mxfp4", override], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.search(message, proc.stderr.strip().splitlines()[-1]), proc.stderr[-500:]
