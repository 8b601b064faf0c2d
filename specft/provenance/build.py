"""The provenance of a config: the keyed config (keys.py), the checkpoint's and the
tokenizer's fingerprints, and what the features' and the answers' runners add."""

from __future__ import annotations

from specft.config import RootConfig, aux_layer_ids
from specft.provenance import CACHE_VERSION, tokenizer_fingerprint
from specft.provenance.keys import cache_key
from specft.runners import role_provenance


def build_provenance(cfg: RootConfig, tokenizer, answers: bool = True) -> dict:
    """``answers=False``: without the answers' identity (a server that is down cannot
    give it; cache.locate_cache then looks for the finished cache it answered)."""
    from specft.target_model.loader import checkpoint_fingerprint

    m = cfg.model
    return {
        "version": CACHE_VERSION,
        "checkpoint": checkpoint_fingerprint(m),
        "model": cache_key(m),
        "quant": cache_key(cfg.quant),
        "aux_layer_ids": aux_layer_ids(m),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "data": cache_key(cfg.data),
        "dtype": cfg.cache.dtype,
        **role_provenance(cfg, answers),
    }


