"""The provenance of a config: the keyed config (keys.py), the checkpoint's and the
tokenizer's fingerprints, and what the features' and the answers' engines add."""

from __future__ import annotations

from specft.config import RootConfig, aux_layer_ids
from specft.engines import engine_for
from specft.provenance import CACHE_VERSION, tokenizer_fingerprint
from specft.provenance.keys import cache_key


def build_provenance(cfg: RootConfig, tokenizer, answers: bool = True) -> dict:
    """``answers=False``: without the answers' identity (with_answers adds it; a server
    that is down cannot give it, and cache.locate_cache then looks for the finished cache
    it answered)."""
    from specft.target_model.loader import checkpoint_fingerprint

    m = cfg.model
    provenance = {
        "version": CACHE_VERSION,
        "checkpoint": checkpoint_fingerprint(m),
        "model": cache_key(m),
        "quant": cache_key(cfg.quant),
        "aux_layer_ids": aux_layer_ids(m),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "data": cache_key(cfg.data),
        "dtype": cfg.cache.dtype,
        **engine_for("features", cfg.cache.engine).provenance(cfg),
    }
    return with_answers(cfg, provenance) if answers else provenance


def with_answers(cfg: RootConfig, provenance: dict) -> dict:
    """``provenance`` with what the answers' engine adds (a server: its identity, asked of it)."""
    return {**provenance, **engine_for("answers", cfg.data.regenerate.engine).provenance(cfg)}
