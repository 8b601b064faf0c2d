"""The provenance's hash (a cache's name), the answer key, the tokenizer's fingerprint and
CACHE_VERSION."""

from __future__ import annotations

import hashlib
import json

# Bumped when what the cached numbers mean changes (keys.py classifies the config fields).
CACHE_VERSION = 1


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    payload = json.dumps([vocab, tokenizer.chat_template or ""], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def provenance_hash(provenance: dict) -> str:
    return hashlib.sha256(json.dumps(provenance, sort_keys=True).encode()).hexdigest()[:16]


def answer_key(provenance: dict) -> str:
    """What the answers depend on, from a cache's provenance: everything but the choice
    of conversations (data source, sample count, split, seed; those are in the
    conversation's own digest) and the regenerated share (data.regenerate.fraction)."""
    data = provenance.get("data", {})
    regen = {k: v for k, v in data.get("regenerate", {}).items() if k != "fraction"}
    fields = {name: provenance.get(name) for name in ("version", "checkpoint", "model", "quant", "tokenizer")}
    fields["data"] = {"thinking": data.get("thinking"), "regenerate": regen}
    if provenance.get("answers"):  # a server's model (engines/server.py); specft's own engine keeps old keys
        fields["answers"] = provenance["answers"]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
