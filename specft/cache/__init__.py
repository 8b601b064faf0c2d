"""Stage 1: the hidden-state cache. build.py is the recipe (locate, answer, compute
features, write); served.py the target as it is served; writer, reader, manifest, storage,
integrity and info the cache's files."""

from specft.cache.build import ensure_cache, locate_cache
from specft.cache.reader import CacheReader, SourcesReader
from specft.cache.served import ServedTarget, serve_target, served_samples
from specft.cache.writer import CacheWriter

__all__ = ["CacheReader", "CacheWriter", "ServedTarget", "SourcesReader", "ensure_cache", "locate_cache",
           "serve_target", "served_samples"]
