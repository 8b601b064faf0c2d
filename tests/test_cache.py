"""Stage 1 cache: round trip, resume after interruption, refusal of mismatched caches."""

import json

import pytest
import torch

from specft.cache import CacheReader, ensure_cache, locate_cache
from specft.cache.writer import CacheWriter
from specft.common.errors import SpecftError
from specft.config import aux_layer_ids
from specft.data import load_samples
from specft.quant import apply_quant
from specft.target_model import FeatureCapture, load_target

from helpers import root_cfg


def _cfg(tmp_path, *extra):
    return root_cfg("model=tiny_qwen3", "quant=mxfp4", "data.num_samples=10",
                    "cache.samples_per_shard=4", "cache.batch_size=3", "cache.dtype=fp32",
                    f"cache.root={tmp_path / 'cache'}", *extra)


def test_cache_round_trip_matches_the_quantized_target(tmp_path):
    cfg = _cfg(tmp_path)
    cache_dir = ensure_cache(cfg)
    reader = CacheReader(cache_dir)
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_samples"] == 10 == len(reader)
    assert len(manifest["shards"]) == 3 and manifest["aux_layer_ids"] == [1, 3, 4]
    model, tok = load_target(cfg.model)
    apply_quant(model, cfg.quant)
    capture = FeatureCapture(model, aux_layer_ids(cfg.model))
    samples = load_samples(cfg.data, tok)
    for i in (0, 5, 9):
        s = samples[i]
        aux, final = capture(s.input_ids[None], torch.ones(1, len(s.input_ids), dtype=torch.long))
        got = reader[i]
        assert torch.equal(got["input_ids"], s.input_ids)
        assert torch.equal(got["loss_mask"], s.loss_mask.float())
        assert got["aux_hidden"].shape == (len(s.input_ids), 3 * cfg.model.hidden_size)
        # Padded batches vs one sample differ only by summation order.
        torch.testing.assert_close(got["aux_hidden"], aux[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got["final_hidden"], final[0], rtol=1e-4, atol=1e-4)
    head = reader.target_head()
    torch.testing.assert_close(reader[0]["final_hidden"] @ head["lm_head"].T,
                               model(reader[0]["input_ids"][None]).logits[0], rtol=1e-4, atol=1e-4)
    # Stage 2 reads the head by row range (sharded) and by draft-vocabulary ids.
    assert torch.equal(reader.target_head_rows(100, 300), head["lm_head"][100:300])
    ids = torch.tensor([7, 2000, 3, 3])
    assert torch.equal(reader.target_head_rows_at(ids), head["lm_head"][ids])
    assert reader.target_head_vocab() == head["lm_head"].shape[0]
    assert torch.equal(reader.target_embedding(), head["embed_tokens"])


def test_interrupted_cache_resumes_to_the_same_result(tmp_path, monkeypatch):
    ref_dir = ensure_cache(_cfg(tmp_path / "ref"))
    cfg = _cfg(tmp_path / "resumed")
    real = CacheWriter._save_shard
    calls = {"n": 0}

    def crash_after_one(self, *a, **k):
        if calls["n"] == 1:
            raise KeyboardInterrupt("simulated kill")
        calls["n"] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(CacheWriter, "_save_shard", crash_after_one)
    with pytest.raises(KeyboardInterrupt):
        ensure_cache(cfg)
    monkeypatch.setattr(CacheWriter, "_save_shard", real)
    partial_dir = locate_cache(cfg)[0]
    stale = partial_dir / ".shard-r000-000001.safetensors.x1y2"  # a write cut by kill -9
    stale.write_bytes(b"half a shard")
    written = []
    monkeypatch.setattr(CacheWriter, "_save_shard",
                        lambda self, tensors, file, progress:
                        written.append(file) or real(self, tensors, file, progress))
    cache_dir = ensure_cache(cfg)
    assert written == ["shard-r000-000001.safetensors", "shard-r000-000002.safetensors"]
    assert not stale.exists()
    ref, got = CacheReader(ref_dir), CacheReader(cache_dir)
    assert len(ref) == len(got)
    for i in range(len(ref)):
        for key, value in ref[i].items():
            assert torch.equal(value, got[i][key]), (i, key)


def test_complete_cache_is_reused_without_the_target(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    first = ensure_cache(cfg)
    import specft.target_model as target_mod

    monkeypatch.setattr(target_mod, "load_target", lambda *a, **k: pytest.fail("target loaded"))
    assert ensure_cache(cfg) == first


def test_mismatched_cache_is_refused_naming_the_field(tmp_path):
    shared_dir = tmp_path / "one-cache"
    ensure_cache(_cfg(tmp_path, f"cache.dir={shared_dir}"))
    with pytest.raises(SpecftError, match=r"quant\.name: cache has 'mxfp4', this run has 'fp8'"):
        ensure_cache(_cfg(tmp_path, f"cache.dir={shared_dir}", "quant=fp8"))
    with pytest.raises(SpecftError, match=r"aux_layer_ids"):
        ensure_cache(_cfg(tmp_path, f"cache.dir={shared_dir}", "model.aux_layer_ids=[0,2,5]"))
    with pytest.raises(SpecftError, match=r"data\.num_samples: cache has 10, this run has 8"):
        ensure_cache(_cfg(tmp_path, f"cache.dir={shared_dir}", "data.num_samples=8"))
    with pytest.raises(SpecftError, match=r"data\.split"):
        ensure_cache(_cfg(tmp_path, f"cache.dir={shared_dir}", "data.split=train"))
    with pytest.raises(SpecftError, match=r"checkpoint|model\."):
        ensure_cache(_cfg(tmp_path, f"cache.dir={shared_dir}", "model=tiny_qwen3_moe"))
    # A tokenizer that changed under the same model name (e.g. an updated hub revision).
    manifest = json.loads((shared_dir / "manifest.json").read_text())
    manifest["provenance"]["tokenizer"] = "0" * 16
    (shared_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecftError, match=r"tokenizer"):
        ensure_cache(_cfg(tmp_path, f"cache.dir={shared_dir}"))


def test_fp8_storage_is_e4m3_with_per_token_group_scales(tmp_path):
    exact = CacheReader(ensure_cache(_cfg(tmp_path)))  # fp32 storage
    fp8_dir = ensure_cache(_cfg(tmp_path, "cache.dtype=fp8"))
    bf16_dir = ensure_cache(_cfg(tmp_path, "cache.dtype=bf16"))
    fp8 = CacheReader(fp8_dir)
    for i in range(len(exact)):
        for key, groups in (("aux_hidden", 3), ("final_hidden", 1)):
            x, y = exact[i][key], fp8[i][key]
            g = x.reshape(len(x), groups, -1)
            scale = g.abs().amax(-1, keepdim=True) / 448.0
            # E4M3: 3 mantissa bits (half step 2^-4 relative); subnormal half step 2^-10 * scale
            bound = g.abs() / 16 + scale / 1024
            assert ((y.reshape(g.shape) - g).abs() <= bound * (1 + 1e-6)).all(), (i, key)
    size = {d: sum(p.stat().st_size for p in d.glob("shard-*")) for d in (fp8_dir, bf16_dir)}
    assert 0.45 < size[fp8_dir] / size[bf16_dir] < 0.6, size


# -- damage ---------------------------------------------------------------------------

def _damage(cache_dir, kind: str) -> str:
    """Damage one file; returns its name."""
    shard = sorted(cache_dir.glob("shard-*.safetensors"))[1].name
    head = "target_head.safetensors"
    if kind == "garbage manifest":
        (cache_dir / "manifest.json").write_bytes(b"\xff\xfe not text \x00" * 5)
        return "manifest.json"
    name = head if "head" in kind else shard
    path = cache_dir / name
    data = path.read_bytes()
    if kind.startswith("missing"):
        path.unlink()
    elif kind.startswith("truncated"):
        path.write_bytes(data[: len(data) // 2])
    elif kind.startswith("empty"):
        path.write_bytes(b"")
    else:  # flipped bytes in the data, size unchanged
        header = 8 + int.from_bytes(data[:8], "little")
        mid = header + (len(data) - header) // 2
        path.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid: mid + 16]) + data[mid + 16:])
    return name


@pytest.mark.parametrize("kind", ["missing shard", "truncated shard", "empty shard", "flipped shard",
                                  "truncated head", "flipped head", "garbage manifest"])
def test_damaged_cache_is_found_and_only_the_damage_is_rebuilt(tmp_path, kind):
    import shutil

    from specft.cache.info import describe

    ref_cfg = root_cfg("model=tiny_qwen3", "quant=mxfp4", "data.num_samples=12", "cache.samples_per_shard=4",
                       "cache.dtype=fp32", f"cache.dir={tmp_path / 'ref'}")
    ref = ensure_cache(ref_cfg)
    work = tmp_path / "work"
    shutil.copytree(ref, work)
    name = _damage(work, kind)
    untouched = {p.name: p.read_bytes() for p in work.glob("shard-*") if p.name != name}
    if kind == "garbage manifest":
        with pytest.raises(SpecftError, match="manifest.json"):
            describe(work, verify=True)
    else:
        text, damage = describe(work, verify=True)
        assert [d.file for d in damage] == [name] and "DAMAGED" in text
        if not kind.startswith("flipped"):  # sizes are checked on every open
            with pytest.raises(SpecftError, match=name):
                CacheReader(work)
    cfg = root_cfg("model=tiny_qwen3", "quant=mxfp4", "data.num_samples=12", "cache.samples_per_shard=4",
                   "cache.dtype=fp32", f"cache.dir={work}")
    assert ensure_cache(cfg, verify=True) == work
    assert describe(work, verify=True)[1] == []
    assert {p.name: p.read_bytes() for p in work.glob("shard-*") if p.name in untouched} == untouched
    a, b = CacheReader(ref), CacheReader(work)
    assert len(a) == len(b)
    for i in range(len(a)):
        sa, sb = a[i], b[i]
        assert all(torch.equal(sa[k], sb[k]) for k in sa), i
    assert torch.equal(a.target_head()["lm_head"], b.target_head()["lm_head"])
