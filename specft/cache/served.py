"""The target as it is served, for stage 1's cache and for online training: loaded, placed
on this rank, quantized, calibrated, and the data's samples as it serves them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specft.config import RootConfig

if TYPE_CHECKING:
    from specft.target_model.sharding import PlacedTarget

log = logging.getLogger(__name__)


def _calibration_batches(samples, n: int):
    """The first ``n`` samples, one at a time: every rank calibrates on the same data, so
    static scales agree across ranks."""
    for s in [s for s in samples if s is not None][:n]:
        yield {"input_ids": s.input_ids[None]}


@dataclass
class ServedTarget:
    """The target as it is served: placed on this rank (whole or sharded), quantized and
    calibrated. Stage 1 caches its features; online training (trainer.features=online)
    computes them inside stage 2."""
    placed: PlacedTarget
    report: object  # quant.apply's QuantReport
    tokenizer: object

    @property
    def model(self):
        return self.placed.model


def serve_target(cfg: RootConfig, rank: int, world_size: int, convs, tokenizer) -> ServedTarget:
    """Load, place, quantize and calibrate the target (``convs``: the calibration data)."""
    from specft.data import DataSummary, tokenize_all
    from specft.quant import apply_quant, calibrate
    from specft.target_model.sharding import editing, place_target

    placed = place_target(cfg, rank, world_size)
    report = apply_quant(placed.model, cfg.quant, editing(placed))
    if cfg.quant.needs_calibration:
        calib = tokenize_all(convs, tokenizer, cfg.data, DataSummary())
        calibrate(placed.model, report, _calibration_batches(calib, cfg.quant.calibration_samples))
    log.info("quant %s: %s", cfg.quant.name, report.summary())
    return ServedTarget(placed, report, tokenizer)


def served_samples(cfg: RootConfig, target: ServedTarget, convs, regen_dir: Path, summary,
                   provenance: dict) -> list:
    """The data's samples as the target serves them: its own answers first when
    data.regenerate is on (resumable, kept in ``regen_dir``, reusing what caches next to
    it answered under the same target and settings, by ``provenance``'s answer key); None
    where a sample is skipped or, with several data slices, another rank's."""
    from specft.data import tokenize_all
    from specft.data.regenerate import regenerate
    from specft.provenance import answer_key

    p = target.placed
    if cfg.data.regenerate.enabled:
        key = answer_key(provenance)
        convs = regenerate(target.model, target.tokenizer, convs, cfg.data, regen_dir, p.data_rank,
                           p.data_world, summary, p.writer, p.lockstep, answer_key=key)
    return tokenize_all(convs, target.tokenizer, cfg.data, summary)
