"""What a cache's numbers and a store's answers depend on: the provenance (a dict of the
keyed config, the checkpoint's and tokenizer's fingerprints and what the engines add), its
hash (the cache's name) and the answer key. Below both data/ and cache/: regeneration keys
its answers and stage 1 names its cache from the same record, and neither reaches into the
other for it. build.py assembles the record (it asks the engines and the checkpoint),
hashes.py hashes it, keys.py says which config fields join it and why."""

from specft.provenance.hashes import (
    CACHE_VERSION,
    answer_key,
    provenance_hash,
    tokenizer_fingerprint,
)

__all__ = ["CACHE_VERSION", "answer_key", "provenance_hash", "tokenizer_fingerprint"]
