"""The engines (specft/engines/): one registry of the ways of running the target,
each doing answers (data.regenerate.engine), features (cache.engine) or both. The
refusals run in the default suite; the llama.cpp engine itself is in
tests/test_llamacpp.py, a real llama-server answering in tests/test_answer_server.py."""

import pytest
from test_gguf_checkpoints import gguf_file

from specft.common.errors import ConfigError
from specft.engines import ENGINES, engine_for

from helpers import root_cfg

GGUF = ("model=hf", f"model.path={gguf_file('Q8_0')}", "quant=checkpoint")
# DFlash reads any number of target layers: two fit the 3-layer fixture below its last
DFLASH = ("draft=dflash", "model.aux_layer_ids=[0,1]")


def test_the_engines_are_one_registry_and_each_field_takes_those_with_its_role():
    assert ENGINES.names == ["llamacpp", "server", "specft", "torch"]
    assert ENGINES.get("torch") is ENGINES.get("specft")  # cache.engine's older name
    with pytest.raises(ConfigError, match=r"cache.engine: unknown engine 'vllm'; allowed: llamacpp, server, "
                                          r"specft, torch"):
        root_cfg("cache.engine=vllm")
    with pytest.raises(ConfigError, match=r"cache.engine: the engine 'server' does not do features; those "
                                          r"that do: llamacpp, specft, torch"):
        root_cfg("cache.engine=server")
    with pytest.raises(ConfigError, match=r"data.regenerate.engine: the engine 'llamacpp' does not do "
                                          r"answers; those that do: server, specft, torch"):
        root_cfg("data.regenerate.enabled=true", "data.regenerate.engine=llamacpp")


def test_the_torch_engine_leaves_the_cache_name_as_it_was():
    """Caches built before cache.engine existed keep their provenance (and so their path)."""
    assert engine_for("features", "torch").provenance(root_cfg(*GGUF, *DFLASH)) == {}
    assert engine_for("features", "llamacpp").provenance(root_cfg(*GGUF, *DFLASH, "cache.engine=llamacpp")) == \
        {"engine": "llamacpp"}


@pytest.mark.parametrize("overrides, message", [
    (("model=tiny_qwen3",), r"cache.engine=llamacpp: needs a GGUF target as llama.cpp serves it"),
    ((*GGUF, *DFLASH, "trainer.features=online"), r"trainer.features=online computes the features in torch"),
    ((*GGUF, *DFLASH, "cache.sharding=zero3"), r"llama.cpp holds the whole target"),
    ((*GGUF, "draft=dflash", "model.aux_layer_ids=[0,2]"), r"layer 2's output is the final norm's"),
])
def test_what_llamacpp_cannot_compute_is_refused_at_config_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        root_cfg(*overrides, "cache.engine=llamacpp")


def test_a_missing_llamacpp_is_one_line_and_no_cache(tmp_path, monkeypatch, cli):
    monkeypatch.setenv("SPECFT_LLAMACPP", str(tmp_path / "no-llamacpp"))
    out = cli(["cache", *GGUF, *DFLASH, "cache.engine=llamacpp", f"cache.dir={tmp_path / 'cache'}",
               "data.num_samples=4", "hydra.run.dir=run"], cwd=tmp_path, check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [ln for ln in out.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "install it with `bash scripts/install_llamacpp.sh`" in errors[0], out.stderr[-2000:]
    assert not (tmp_path / "cache").exists()


class ToyAnswers:
    """An engine's answers role as docs/extending.md writes one: every prompt answered
    with its own last three tokens (no model run)."""

    prompts = 0

    def validate(self, cfg):
        return None

    def provenance(self, cfg):
        return {"answers": {"engine": "toy"}}

    def answerer(self, rc):
        def answer(model, tokenizer, prompts, seed, synced):
            ToyAnswers.prompts += len(prompts)
            return [p[-3:] for p in prompts], [False] * len(prompts)

        return answer


class ToyFeatures:
    """Its features role: specft's own capture, halved."""

    batches = 0

    def validate(self, cfg):
        return None

    def check_ready(self, cfg):
        return None

    def capture(self, cfg, model):
        inner = engine_for("features", "specft").capture(cfg, model)

        def capture(input_ids, attention_mask):
            ToyFeatures.batches += 1
            aux, final = inner(input_ids, attention_mask)
            return aux * 0.5, final * 0.5

        return capture

    def provenance(self, cfg):
        return {"engine": "toy"}


@pytest.fixture
def toy_engine():
    from specft.engines import Engine

    ENGINES.register("toy")(Engine("a toy engine", answers=ToyAnswers(), features=ToyFeatures()))
    yield
    ENGINES._entries.pop("toy")


def test_a_new_engine_registers_from_its_own_code_and_stage_one_runs_through_both_roles(toy_engine, tmp_path,
                                                                                          monkeypatch):
    """docs/extending.md's "A way of running the target": a class per role, one Engine
    registered, nothing else in specft edited; `specft cache` answers and computes
    features through it and names the cache by what it adds."""
    import json

    from specft.cli import main
    from specft.engines import Answers, Features

    assert isinstance(ToyAnswers(), Answers) and isinstance(ToyFeatures(), Features)
    monkeypatch.chdir(tmp_path)
    args = ["cache", "model=tiny_qwen3", "data.num_samples=4", "data.regenerate.enabled=true",
            "data.regenerate.engine=toy", "data.regenerate.max_new_tokens=8", "cache.engine=toy",
            f"cache.root={tmp_path / 'cache'}", "hydra.run.dir=run"]
    assert main(args) == 0
    assert ToyAnswers.prompts >= 4 and ToyFeatures.batches > 0
    (manifest,) = (tmp_path / "cache").glob("*/manifest.json")
    provenance = json.loads(manifest.read_text())["provenance"]
    assert provenance["engine"] == "toy" and provenance["answers"] == {"engine": "toy"}
