"""Data sources, chat templates and the assistant loss mask."""

import json

import pytest

from specft.config import DataConfig
from specft.data import load_samples, tokenize_conversation
from specft.errors import SpecftError
from specft.target.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(2048)


def _masked_text(tok, sample):
    return tok.decode(sample.input_ids[sample.loss_mask.bool()].tolist())


def test_mask_covers_exactly_the_assistant_turns(tok):
    conv = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tom has 3 apples."},
            {"role": "assistant", "content": "The answer is 3."},
            {"role": "user", "content": "And 4 more?"},
            {"role": "assistant", "content": "Then 3 + 4 = 7."}]
    s = tokenize_conversation(tok, conv, 512)
    assert _masked_text(tok, s) == "The answer is 3.<|im_end|>\nThen 3 + 4 = 7.<|im_end|>\n"
    # Everything unmasked is template or user/system text.
    unmasked = tok.decode(s.input_ids[~s.loss_mask.bool()].tolist())
    assert "Tom has 3 apples." in unmasked and "Be brief." in unmasked
    assert "The answer" not in unmasked


def test_truncation_and_no_assistant_tokens(tok):
    conv = [{"role": "user", "content": "Tom has 3 apples. " * 20},
            {"role": "assistant", "content": "Yes."}]
    assert tokenize_conversation(tok, conv, 10) is None  # the answer was cut off
    s = tokenize_conversation(tok, conv, 1000)
    assert len(s.input_ids) < 1000 and s.loss_mask.sum() > 0


def test_synthetic_source_is_deterministic(tok):
    a = load_samples(DataConfig(name="synthetic", num_samples=8, seed=3), tok)
    b = load_samples(DataConfig(name="synthetic", num_samples=8, seed=3), tok)
    c = load_samples(DataConfig(name="synthetic", num_samples=8, seed=4), tok)
    assert all((x.input_ids == y.input_ids).all() for x, y in zip(a, b))
    assert any(len(x.input_ids) != len(y.input_ids) or (x.input_ids != y.input_ids).any()
               for x, y in zip(a, c))


def test_file_sources_skip_bad_records(tok, tmp_path, caplog):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n{not json\n"
                   + json.dumps({"foo": 1}) + "\n")
    assert len(load_samples(DataConfig(name="gsm8k", path=str(gsm), num_samples=10), tok)) == 1
    assert "1 bad_json" in caplog.text and "1 unknown_record" in caplog.text
    share = tmp_path / "sg.json"
    share.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"conversations": [{"from": "robot", "value": "?"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
    ]))
    assert len(load_samples(DataConfig(name="sharegpt", path=str(share), num_samples=10), tok)) == 1
    jl = tmp_path / "m.jsonl"
    jl.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                           {"role": "assistant", "content": "a"}]}) + "\n"
                  + json.dumps({"prompt": "p", "response": "r"}) + "\n")
    assert len(load_samples(DataConfig(name="jsonl", path=str(jl), num_samples=10), tok)) == 2


def test_missing_file_is_one_clear_error(tok, tmp_path):
    with pytest.raises(SpecftError, match="data.path: no such file"):
        load_samples(DataConfig(name="gsm8k", path=str(tmp_path / "nope.jsonl")), tok)
