"""The cache key: every field of the dataclasses it reads is classified, and the keys of
today's config values are the ones caches were built under."""

import dataclasses

import pytest

from specft.provenance import provenance_hash
from specft.provenance.keys import KEYED, KEYED_WHEN_SET, NOT_KEYED, cache_key

from helpers import CONF, root_cfg


@pytest.mark.parametrize("cls", list(KEYED), ids=lambda c: c.__name__)
def test_every_field_is_classified_once(cls):
    names = {f.name for f in dataclasses.fields(cls)}
    keyed, skipped = set(KEYED[cls]), set(NOT_KEYED[cls])
    assert not keyed & skipped, f"{cls.__name__}: both keyed and not: {keyed & skipped}"
    unclassified = names - keyed - skipped
    assert not unclassified, (f"{cls.__name__}.{sorted(unclassified)}: new fields; add each to KEYED (it changes "
                              "the cached numbers) or NOT_KEYED (with why) in specft/provenance/keys.py")
    assert keyed | skipped <= names, f"{cls.__name__}: classified fields that do not exist"


def _without(value, cls_fields, when_set=(), cls=None):
    """asdict output less the NOT_KEYED fields and the KEYED_WHEN_SET ones left at their
    defaults (the key must equal the rest)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)} if cls else {}
    return {k: v for k, v in value.items()
            if k not in cls_fields and not (k in when_set and v == defaults.get(k))}


SHIPPED = [("data", p.stem) for p in sorted((CONF / "data").glob("*.yaml"))] + \
    [("quant", p.stem) for p in sorted((CONF / "quant").glob("*.yaml"))] + \
    [("model", p.stem) for p in sorted((CONF / "model").glob("*.yaml"))]


@pytest.mark.parametrize("group,name", SHIPPED, ids=[f"{g}={n}" for g, n in SHIPPED])
def test_shipped_configs_keep_their_keys(group, name):
    """The key of every shipped data, quant and model config is what asdict gave before
    the key was an explicit list: existing caches keep their names."""
    overrides = [f"{group}={name}"]
    data = name if group == "data" else None
    if data in ("jsonl", "sharegpt", "gsm8k", "mtbench", "ceval", "hf"):
        overrides.append("data.path=somewhere")
    if data == "mix":
        overrides.append("data.mix=[{name: gsm8k, path: a.jsonl, num_samples: 3}]")
    if (group, name) in (("model", "hf"), ("quant", "checkpoint")):  # need a checkpoint to read
        overrides += ["model=hf", f"model.path={CONF.parent / 'tests/fixtures/checkpoints/tiny_qwen3/fp8_dynamic'}",
                      "quant=checkpoint"]
    cfg = root_cfg(*overrides)
    data_key = _without(dataclasses.asdict(cfg.data), NOT_KEYED[type(cfg.data)], KEYED_WHEN_SET[type(cfg.data)],
                        type(cfg.data))
    data_key["regenerate"] = _without(data_key["regenerate"], NOT_KEYED[type(cfg.data.regenerate)],
                                      KEYED_WHEN_SET[type(cfg.data.regenerate)], type(cfg.data.regenerate))
    assert cache_key(cfg.data) == data_key
    assert cache_key(cfg.quant) == _without(dataclasses.asdict(cfg.quant), NOT_KEYED[type(cfg.quant)],
                                            KEYED_WHEN_SET[type(cfg.quant)], type(cfg.quant))
    model = cache_key(cfg.model)
    assert model == _without(dataclasses.asdict(cfg.model), NOT_KEYED[type(cfg.model)])


def test_key_hashes_are_pinned():
    # Computed from dataclasses.asdict before the explicit list (commit 83629d1).
    cfg = root_cfg()
    assert provenance_hash({"data": cache_key(cfg.data), "quant": cache_key(cfg.quant)}) == "052adb889b31aded"
    cfg = root_cfg("data=mix", "data.mix=[{name: gsm8k, path: a.jsonl, num_samples: 3}]", "quant=nvfp4")
    assert provenance_hash({"data": cache_key(cfg.data), "quant": cache_key(cfg.quant)}) == "76a90115741b8c2a"
    assert provenance_hash(cache_key(root_cfg("model=qwen3_32b").model)) == "db3aa55af272d774"


def test_an_unclassified_dataclass_is_refused():
    @dataclasses.dataclass
    class Stray:
        x: int = 1

    with pytest.raises(TypeError, match="no field classification"):
        cache_key({"a": [Stray()]})
