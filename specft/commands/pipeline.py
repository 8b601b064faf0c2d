"""The job, top to bottom, for one rank (worker.py sets the rank up and calls run_job):

1. stage 1: the training cache (built or repaired if needed; `specft cache` hashes all);
2. the other caches training reads: the held-out cache with the target's own answers
   (trainer.val_data=heldout) and a second target's cache (trainer.mix_quant);
3. stage 2: train the draft; the final checkpoint's folder is the result.

With trainer.features=online, `specft train` skips 1 and 2: the served target is loaded
into stage 2 and computes the features as training reads them (train/online.py).

`specft eval` and `specft export` read a finished run (eval/, export/)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from specft.cache import ensure_cache
from specft.common.registry import Registry
from specft.config import RootConfig
from specft.data.select import heldout_sides
from specft.quant.config import load_quant_config

log = logging.getLogger(__name__)


def with_quant(cfg: RootConfig, name: str) -> RootConfig:
    """The same run with another target quant config (for mixed-target training)."""
    return dataclasses.replace(cfg, quant=load_quant_config(name, "trainer.mix_quant"))


def with_heldout_data(cfg: RootConfig) -> dict[str, RootConfig]:
    """The same run on each source's validation side, answers written by the target."""
    return {source: dataclasses.replace(cfg, data=side)
            for source, side in heldout_sides(cfg.data, cfg.trainer.val_samples).items()}


def caches_needed(cfg: RootConfig, command: str) -> list[RootConfig]:
    """The config of every cache a job reads, in the order run_job builds them."""
    if command == "train" and cfg.trainer.features == "online":
        return []
    configs = [cfg]
    if command == "cache":
        return configs
    if cfg.trainer.mix_quant is not None:
        configs.append(with_quant(cfg, cfg.trainer.mix_quant))
    if cfg.trainer.val_data == "heldout":
        configs += with_heldout_data(cfg).values()
    return configs


def cached_features(cfg: RootConfig, rank: int, world: int):
    """(training, trainer.mix_quant, held-out) readers over stage 1's caches, built first
    where missing."""
    from specft.cache import CacheReader, SourcesReader

    reader = CacheReader(ensure_cache(cfg, rank, world))
    mix = None
    if cfg.trainer.mix_quant is not None:
        mix = CacheReader(ensure_cache(with_quant(cfg, cfg.trainer.mix_quant), rank, world))
    val = None
    if cfg.trainer.val_data == "heldout":
        val_dirs = {}
        for source, side in with_heldout_data(cfg).items():
            log.info("validation cache (%s): up to %d held-out conversations, answers by the target",
                     source, cfg.trainer.val_samples)
            val_dirs[source] = ensure_cache(side, rank, world)
        val = SourcesReader.from_dirs(val_dirs)
    return reader, mix, val


def online_features(cfg: RootConfig, rank: int, world: int):
    """The same readers with the target computing the features in training (no mix:
    validate.py refuses trainer.mix_quant online)."""
    from specft.train.online import online_readers

    heldout = with_heldout_data(cfg) if cfg.trainer.val_data == "heldout" else None
    reader, val = online_readers(cfg, rank, world, heldout)
    return reader, None, val


# trainer.features: where stage 2's features come from.
FEATURES = Registry("feature source")
FEATURES.register("cache")(cached_features)
FEATURES.register("online")(online_features)


def run_job(cfg: RootConfig, command: str, rank: int, world: int) -> Path:
    if command == "cache":
        return ensure_cache(cfg, rank, world, verify=True)
    readers = FEATURES.get(cfg.trainer.features, "trainer.features")(cfg, rank, world)
    from specft.train.trainer import Trainer  # DeepSpeed and the heads load only to train

    return Trainer(cfg, readers[0], rank, world, *readers[1:]).train()
