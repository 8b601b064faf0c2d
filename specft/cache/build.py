"""Stage 1's recipe: find the cache a config names, and build (or finish, or repair) it."""

from __future__ import annotations

import logging
from pathlib import Path

from specft.cache.integrity import drop_damaged
from specft.cache.manifest import atomic_write_json
from specft.cache.served import serve_target, served_samples
from specft.cache.writer import (
    CacheWriter,
    answered_cache_provenance,
    cache_is_complete,
    merge_manifest,
    resolve_cache_dir,
    save_side_files,
    target_head_tensors,
)
from specft.common.errors import SpecftError
from specft.common.launch import barrier
from specft.config import RootConfig
from specft.engines import EngineUnreachable, engine_for
from specft.provenance.build import build_provenance, with_answers

log = logging.getLogger(__name__)


def locate_cache(cfg: RootConfig):
    """(cache dir, provenance, tokenizer) for this config, without loading the model."""
    from specft.target_model import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    base = build_provenance(cfg, tokenizer, answers=False)
    try:
        provenance = with_answers(cfg, base)
    except EngineUnreachable as err:  # a server that wrote the answers is down
        provenance = answered_cache_provenance(cfg, base, err)
    return resolve_cache_dir(cfg, provenance), provenance, tokenizer


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
    engine = engine_for("features", cfg.cache.engine)
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
