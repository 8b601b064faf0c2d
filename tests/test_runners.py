"""The target runners (specft/runners/): one registry of the ways of running the target,
each doing answers (data.regenerate.engine), features (cache.engine) or both. The
refusals run in the default suite; the llama.cpp engine itself is in
tests/test_llamacpp.py, a real llama-server answering in tests/test_answer_server.py."""

import pytest
from test_gguf_checkpoints import gguf_file

from specft.errors import ConfigError
from specft.runners import TARGET_RUNNERS, runner_for

from helpers import root_cfg

GGUF = ("model=hf", f"model.path={gguf_file('Q8_0')}", "quant=checkpoint")
# DFlash reads any number of target layers: two fit the 3-layer fixture below its last
DFLASH = ("draft=dflash", "model.aux_layer_ids=[0,1]")


def test_the_runners_are_one_registry_and_each_field_takes_those_with_its_role():
    assert TARGET_RUNNERS.names == ["llamacpp", "server", "specft", "torch"]
    assert TARGET_RUNNERS.get("torch") is TARGET_RUNNERS.get("specft")  # cache.engine's older name
    with pytest.raises(ConfigError, match=r"cache.engine: unknown target runner 'vllm'; allowed: llamacpp, server, "
                                          r"specft, torch"):
        root_cfg("cache.engine=vllm")
    with pytest.raises(ConfigError, match=r"cache.engine: the target runner 'server' does not do features; those "
                                          r"that do: llamacpp, specft, torch"):
        root_cfg("cache.engine=server")
    with pytest.raises(ConfigError, match=r"data.regenerate.engine: the target runner 'llamacpp' does not do "
                                          r"answers; those that do: server, specft, torch"):
        root_cfg("data.regenerate.enabled=true", "data.regenerate.engine=llamacpp")


def test_the_torch_engine_leaves_the_cache_name_as_it_was():
    """Caches built before cache.engine existed keep their provenance (and so their path)."""
    assert runner_for("features", "torch").provenance(root_cfg(*GGUF, *DFLASH)) == {}
    assert runner_for("features", "llamacpp").provenance(root_cfg(*GGUF, *DFLASH, "cache.engine=llamacpp")) == \
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
