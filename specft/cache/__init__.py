"""Stage 1: the hidden-state cache (writer, reader, manifest)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specft.cache.integrity import drop_damaged
from specft.cache.manifest import atomic_write_json
from specft.cache.reader import CacheReader, SourcesReader
from specft.cache.writer import (
    CacheWriter,
    answered_cache_provenance,
    cache_is_complete,
    merge_manifest,
    resolve_cache_dir,
    save_side_files,
    target_head_tensors,
)
from specft.config import RootConfig
from specft.errors import SpecftError
from specft.launch import barrier
from specft.provenance.build import build_provenance, with_answers
from specft.runners import RunnerUnreachable, runner_for

if TYPE_CHECKING:
    from specft.target_model.sharding import PlacedTarget

log = logging.getLogger(__name__)


def _calibration_batches(samples, n: int):
    """The first ``n`` samples, one at a time: every rank calibrates on the same data, so
    static scales agree across ranks."""
    for s in [s for s in samples if s is not None][:n]:
        yield {"input_ids": s.input_ids[None]}


def locate_cache(cfg: RootConfig):
    """(cache dir, provenance, tokenizer) for this config, without loading the model."""
    from specft.target_model import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    base = build_provenance(cfg, tokenizer, answers=False)
    try:
        provenance = with_answers(cfg, base)
    except RunnerUnreachable as err:  # a server that wrote the answers is down
        provenance = answered_cache_provenance(cfg, base, err)
    return resolve_cache_dir(cfg, provenance), provenance, tokenizer


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


def ensure_cache(cfg: RootConfig, rank: int = 0, world_size: int = 1, verify: bool = False) -> Path:
    """Build (or finish, or repair) the cache for ``cfg`` unless a complete, intact one
    exists; return its dir. ``verify``: check every file's checksum first (`specft
    cache`), not only a sample of them."""
    from specft.data import DataSummary, load_conversations
    from specft.data import report as data_report
    from specft.target_model.loader import target_facts
    from specft.target_model.sharding import editing

    cache_dir, provenance, tokenizer = locate_cache(cfg)
    if rank == 0 and cache_dir.is_dir():
        drop_damaged(cache_dir, verify)  # a damaged cache is rebuilt where it is damaged only
    barrier(world_size)
    if cache_is_complete(cache_dir, provenance):
        log.info("cache: reusing %s", cache_dir)
        return cache_dir
    barrier(world_size)  # every rank has checked before rank 0 may write a manifest
    engine = runner_for("features", cfg.cache.engine)
    engine.check_ready(cfg)  # a missing engine is refused before anything is computed or written
    summary = DataSummary()
    convs = load_conversations(cfg.data, summary)
    target = serve_target(cfg, rank, world_size, convs, tokenizer)
    placed, model = target.placed, target.model
    samples = served_samples(cfg, target, convs, cache_dir, summary, provenance)
    data_report(summary)
    capture = engine.capture(cfg, model)
    CacheWriter(cfg, cache_dir, provenance, placed.data_rank, placed.data_world, placed.writer,
                placed.lockstep).write(capture, samples, tokenizer.pad_token_id)
    head = target_head_tensors(model, editing(placed))  # a collective when sharded
    barrier(world_size)
    if rank == 0:
        save_side_files(cache_dir, head, placed.data_world)
        atomic_write_json(cache_dir / "quant_report.json", target.report.to_dict())
        manifest = merge_manifest(cfg, cache_dir, provenance, placed.data_world,
                                  target_facts(cfg.model, model.config), dict(summary))
        if not manifest["num_samples"]:
            raise SpecftError(f"cache: no usable samples; {summary.line()}")
        log.info("cache: %d samples, %d tokens at %s", manifest["num_samples"], manifest["num_tokens"], cache_dir)
    barrier(world_size)
    return cache_dir


__all__ = ["CacheReader", "CacheWriter", "ServedTarget", "SourcesReader", "ensure_cache", "locate_cache",
           "serve_target", "served_samples"]
