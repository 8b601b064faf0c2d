"""Regeneration: the quantized target answers the prompts, batched, resumable, cached."""

import json

import pytest
import torch

from specft.cache import CacheReader, ensure_cache, locate_cache
from specft.config import DataConfig, RegenerateConfig
from specft.data import DataSummary, load_conversations
from specft.data.regenerate import regenerate, store_path
from specft.data.template import prompt_ids
from specft.engines.generate import generate_batch
from specft.quant import apply_quant
from specft.target_model import load_target, load_tokenizer

from helpers import root_cfg


def _cfg(tmp_path, *extra):
    return root_cfg("model=tiny_qwen3", "quant=mxfp4", "data.num_samples=6", "cache.dtype=fp32",
                    "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=12",
                    "data.regenerate.batch_size=4", f"cache.root={tmp_path / 'cache'}", *extra)


def _greedy_one(model, prompt, n):
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_batched_answers_equal_one_at_a_time_greedy(tmp_path):
    cfg = _cfg(tmp_path)
    tok = load_tokenizer(cfg.model)
    model, _ = load_target(cfg.model)
    apply_quant(model, cfg.quant)
    convs = load_conversations(cfg.data)
    prompts = [prompt_ids(tok, c[:1]) for c in convs[:4]]
    answers, capped = generate_batch(model, tok, prompts, RegenerateConfig(max_new_tokens=12), seed=0)
    for prompt, ans, cap in zip(prompts, answers, capped):
        alone = _greedy_one(model, prompt, 12)
        stop = next((j for j, t in enumerate(alone) if t == tok.eos_token_id), None)
        assert ans == (alone[:stop] if stop is not None else alone)
        assert cap == (stop is None)


def test_regenerated_cache_holds_the_targets_answers_and_resumes(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    cache_dir = ensure_cache(cfg)
    tok = load_tokenizer(cfg.model)
    stored = [json.loads(line) for line in store_path(cache_dir, 0).read_text().splitlines()]
    assert sorted(r["index"] for r in stored) == list(range(6))
    original = load_conversations(cfg.data)
    reader = CacheReader(cache_dir)
    manifest = reader.manifest
    assert manifest["data_summary"]["regenerated"] == 6
    assert 0 < manifest["data_summary"]["regen_new_tokens"] <= 6 * 12  # its speed is recorded
    assert manifest["data_summary"]["regen_ms"] > 0
    for rec in stored:
        answer = rec["messages"][-1]["content"]
        assert rec["messages"][:-1] == original[rec["index"]][:-1]  # prompts kept
        assert answer != original[rec["index"]][-1]["content"]  # the random target's words
        sample = reader[reader.indices.index(rec["index"])]
        masked = tok.decode(sample["input_ids"][sample["loss_mask"].bool()].tolist())
        assert answer.strip() in masked
    # Token counts come from what was cached, i.e. the regenerated answers.
    counts = reader.token_counts()
    masked_ids = torch.cat([reader[i]["input_ids"][reader[i]["loss_mask"].bool()] for i in range(len(reader))])
    assert torch.equal(counts, torch.bincount(masked_ids, minlength=counts.numel()))

    # A run killed after the answers were stored resumes without generating again.
    (cache_dir / "manifest.json").unlink()
    for shard in cache_dir.glob("shard-*"):
        shard.unlink()
    (cache_dir / "progress-r000.json").unlink()
    _no_generation(monkeypatch)
    assert ensure_cache(cfg) == cache_dir
    again = CacheReader(cache_dir)
    for i in range(len(reader)):
        assert torch.equal(reader[i]["input_ids"], again[i]["input_ids"])


def test_multi_turn_slots_are_answered_in_order(tmp_path):
    cfg = _cfg(tmp_path, "data.regenerate.max_new_tokens=4")
    tok = load_tokenizer(cfg.model)
    model, _ = load_target(cfg.model)
    convs = [[{"role": "user", "content": "Tom has 3 apples."}, {"role": "assistant", "content": None},
              {"role": "user", "content": "And 4 more?"}, {"role": "assistant", "content": "old"}]]
    seen = []
    real = generate_batch

    def spy(model_, tok_, prompts, rc, seed, **kwargs):
        seen.append(tok.decode(prompts[0]))
        return real(model_, tok_, prompts, rc, seed, **kwargs)

    import specft.engines.generate as mod
    mod_generate = mod.generate_batch
    mod.generate_batch = spy
    try:
        (out,) = regenerate(model, tok, convs, cfg.data, tmp_path / "c", summary=DataSummary())
    finally:
        mod.generate_batch = mod_generate
    assert out[1]["content"] is not None and out[3]["content"] != "old"
    assert len(seen) == 2 and out[1]["content"] in seen[1]  # turn 2 sees the new turn-1 answer


def test_other_ranks_samples_are_left_alone(tmp_path):
    cfg = _cfg(tmp_path)
    cache_dir, _, tok = locate_cache(cfg)
    model, _ = load_target(cfg.model)
    convs = load_conversations(cfg.data)
    out = regenerate(model, tok, convs, cfg.data, cache_dir, rank=1, world_size=2)
    assert [c is None for c in out] == [True, False] * 3


def test_a_fraction_is_answered_by_the_target_and_the_rest_keeps_its_text(tmp_path):
    """data.regenerate.fraction: a seeded share answered, the same on every rank; the
    others keep the dataset's answers, and the cache is named apart from the whole run's."""
    cfg = _cfg(tmp_path, "data.regenerate.fraction=0.5")
    cache_dir = ensure_cache(cfg)
    assert cache_dir != locate_cache(_cfg(tmp_path))[0]
    stored = sorted(json.loads(line)["index"] for line in store_path(cache_dir, 0).read_text().splitlines())
    assert len(stored) == 3
    summary = CacheReader(cache_dir).manifest["data_summary"]
    assert summary["regenerated"] == 3 and summary["kept_fixed_text"] == 3
    original = load_conversations(cfg.data)
    tok = load_tokenizer(cfg.model)
    model, _ = load_target(cfg.model)
    # Rank 1 of 2 answers its share of the same chosen set, and keeps its fixed ones.
    out = regenerate(model, tok, original, cfg.data, tmp_path / "r1", rank=1, world_size=2)
    for i, conv in enumerate(out):
        if i % 2 == 0:
            assert conv is None  # rank 0's
        elif i in stored:
            assert conv[-1]["content"] != original[i][-1]["content"]
        else:
            assert conv == original[i]


def test_every_rank_reads_the_others_answers_and_the_fixed_text(tmp_path):
    """Online training reads every slice: stored answers where the target answered, the
    dataset's text where it was kept (data.regenerate.fraction)."""
    from specft.data.answer_store import append_store
    from specft.data.regenerate import answered_by_target, read_all_answers

    data = DataConfig(regenerate=RegenerateConfig(enabled=True, fraction=0.5, seed=3))
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(8)]
    answered = answered_by_target(convs, data)
    assert len(answered) == 4 and answered == answered_by_target(convs, data)
    for rank in range(2):
        records = [{"index": i, "messages": [convs[i][0], {"role": "assistant", "content": f"new{i}"}]}
                   for i in sorted(answered) if i % 2 == rank]
        append_store(store_path(tmp_path, rank), records)
    out = read_all_answers(tmp_path, convs, 2, data)
    for i, conv in enumerate(out):
        assert conv[-1]["content"] == (f"new{i}" if i in answered else f"a{i}")


def test_a_keep_text_member_keeps_its_text_while_the_target_answers_the_others(tmp_path):
    """data.mix with one member's keep_text: the target answers the synthetic member's
    conversations and none of the jsonl member's, whose text reaches the cache as written;
    its held-out side has every answer regenerated."""
    from specft.data.select import heldout_side

    path = tmp_path / "kept.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Kept question {i}?"},
                                                     {"role": "assistant", "content": f"Kept answer {i}."}]}) + "\n"
                            for i in range(3)))
    cfg = _cfg(tmp_path, "data=mix", "data.split=all",
               f"data.mix=[{{name: synthetic, num_samples: 4}}, {{name: jsonl, path: '{path}', keep_text: true}}]")
    original = load_conversations(cfg.data)
    cache_dir = ensure_cache(cfg)
    summary = CacheReader(cache_dir).manifest["data_summary"]
    assert summary["regenerated"] == 4 and summary["kept_fixed_text"] == 3
    stored = {json.loads(line)["index"] for line in store_path(cache_dir, 0).read_text().splitlines()}
    kept = {i for i, c in enumerate(original) if c[0]["content"].startswith("Kept question")}
    assert len(kept) == 3 and stored == set(range(7)) - kept
    model, _ = load_target(cfg.model)
    out = regenerate(model, load_tokenizer(cfg.model), original, cfg.data, tmp_path / "again")
    for i, conv in enumerate(out):
        assert (conv == original[i]) == (i in kept)
    # Without keep_text the cache is another one, and the held-out side answers all.
    plain = _cfg(tmp_path, "data=mix", "data.split=all",
                 f"data.mix=[{{name: synthetic, num_samples: 4}}, {{name: jsonl, path: '{path}'}}]")
    assert locate_cache(plain)[0] != cache_dir
    assert all("keep_text" not in m for m in heldout_side(cfg.data, 2).mix)


def test_keep_text_is_a_mix_members_field_only(tmp_path):
    from specft.common.errors import ConfigError

    with pytest.raises(ConfigError, match="data.keep_text: a data.mix member's field.*regenerate.enabled=false"):
        _cfg(tmp_path, "data.keep_text=true")
    with pytest.raises(ConfigError, match=r"data.keep_text: a data.mix member's field \(keep"):
        _cfg(tmp_path, "data=mix", "data.keep_text=true", "data.mix=[{name: synthetic, num_samples: 4}]")


def _no_generation(monkeypatch):
    monkeypatch.setattr("specft.engines.generate.generate_batch",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("generated again")))


def test_a_larger_cache_reuses_the_answers_a_smaller_one_stored(tmp_path, monkeypatch):
    """A cache for more samples of the same data asks the target only what no cache next
    to it has answered under the same target and settings; the answers it takes are the
    ones stored there, matched by question, whatever their index."""
    small_dir = ensure_cache(_cfg(tmp_path, "data.num_samples=4"))
    small = {json.dumps(r["messages"][:-1]): r["messages"]
             for r in map(json.loads, store_path(small_dir, 0).read_text().splitlines())}
    asked = []
    real = generate_batch

    def counting(model_, tok_, prompts, rc, seed, **kwargs):
        asked.append(len(prompts))
        return real(model_, tok_, prompts, rc, seed, **kwargs)

    monkeypatch.setattr("specft.engines.generate.generate_batch", counting)
    cfg = _cfg(tmp_path, "data.num_samples=6")
    big_dir = ensure_cache(cfg)
    assert big_dir != small_dir
    summary = CacheReader(big_dir).manifest["data_summary"]
    stored = [json.loads(line) for line in store_path(big_dir, 0).read_text().splitlines()]
    reused = [r for r in stored if json.dumps(r["messages"][:-1]) in small]
    assert summary["regen_reused"] == len(reused) > 0 and summary["regen_reused_tokens"] > 0
    assert sum(asked) == 6 - len(reused)  # only the new questions were asked
    for r in reused:
        assert r["messages"] == small[json.dumps(r["messages"][:-1])]
    assert sorted(r["index"] for r in stored) == list(range(6))


def test_answers_are_not_reused_across_targets_settings_or_when_turned_off(tmp_path, monkeypatch):
    ensure_cache(_cfg(tmp_path))
    for other in ("quant=fp8", "data.regenerate.max_new_tokens=8", "data.regenerate.reuse=false"):
        cfg = _cfg(tmp_path, other, "data.num_samples=5")
        cache_dir, _, _ = locate_cache(cfg)
        monkeypatch.undo()
        ensure_cache(cfg)
        summary = CacheReader(cache_dir).manifest["data_summary"]
        assert summary.get("regen_reused", 0) == 0, other
        assert summary["regen_new_tokens"] > 0, other
    # The same settings under another share (data.regenerate.fraction) do reuse, and
    # generate nothing: every chosen question was answered by the first cache.
    _no_generation(monkeypatch)
    cfg = _cfg(tmp_path, "data.regenerate.fraction=0.5")
    summary = CacheReader(ensure_cache(cfg)).manifest["data_summary"]
    assert summary["regen_reused"] == 3 and summary.get("regen_new_tokens", 0) == 0


def test_a_killed_runs_answers_are_found_by_their_mark(tmp_path, monkeypatch):
    """Answers of a cache that never finished (no manifest) are reusable: the directory
    is marked with its answer key when regeneration starts."""
    from specft.data.answer_store import KEY_FILE

    first = ensure_cache(_cfg(tmp_path))
    (first / "manifest.json").unlink()
    assert (first / KEY_FILE).exists()
    _no_generation(monkeypatch)
    summary = CacheReader(ensure_cache(_cfg(tmp_path, "data.regenerate.fraction=0.5"))).manifest["data_summary"]
    assert summary["regen_reused"] == 3
