"""scripts/studies/steps.py's eval prompt sets: a held-out set holds exactly the conversations a
training run's member of the same source left out, so no eval prompt was trained on."""

import json
import sys
from pathlib import Path

import pytest

from helpers import root_cfg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "studies"))


def _sharegpt_file(path: Path, n: int) -> Path:
    records = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Question number {i}?"},
                                                  {"from": "gpt", "value": f"Answer number {i}."}]}
               for i in range(n)]
    path.write_text(json.dumps(records))
    return path


def _data(overrides: list[str]):
    return root_cfg("model=tiny_qwen3", *overrides).data


def _first_questions(cfg) -> set[str]:
    from specft.data import load_conversations

    return {next(m["content"] for m in conv if m["role"] == "user") for conv in load_conversations(cfg)}


def test_sharegpt_v3_eval_prompts_are_what_a_training_mix_left_out(tmp_path):
    from steps import SHARED, prompt_set

    data = _sharegpt_file(tmp_path / "v3.json", 200)
    held_out = _data([*prompt_set("sharegpt_v3", SHARED, SHARED, 0.3), f"data.path={data}",
                      "data.num_samples=1000"])
    # The scripts' training runs set data.val_fraction=0.1; a mix member inherits it.
    train = _data(["data=mix", "data.split=train", "data.val_fraction=0.1",
                   f"data.mix=[{{name: sharegpt, path: '{data}', num_samples: 1000}}]"])
    held, trained = _first_questions(held_out), _first_questions(train)
    assert held and trained
    assert not held & trained
    assert len(held | trained) == 200
    assert 5 <= len(held) <= 40  # about a tenth


def test_every_prompt_set_names_its_data_source_and_unknown_sets_stop():
    from steps import SHARED, prompt_set

    for name, source in [("gsm8k", "gsm8k"), ("sharegpt", "sharegpt"), ("mtbench", "mtbench"),
                         ("sharegpt_v3", "sharegpt")]:
        assert prompt_set(name, SHARED, SHARED, 0.3)[0] == f"data={source}"
    with pytest.raises(SystemExit, match="unknown prompt set 'alpaca'"):
        prompt_set("alpaca", SHARED, SHARED, 0.3)
