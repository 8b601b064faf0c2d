"""Stage 2's view of the cache: samples read lazily from mmap'd safetensors shards."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specft.cache.integrity import require_intact
from specft.cache.manifest import MANIFEST, read_json
from specft.cache.storage import SCALE_SUFFIX, decode
from specft.cache.writer import TARGET_HEAD, TOKEN_COUNTS, require_unique_samples
from specft.common.errors import SpecftError, first_line


class CacheReader:
    """Index i -> dict(input_ids, loss_mask, aux_hidden, final_hidden) for sample i in the
    global data order (sample_index), whatever rank wrote it."""

    def __init__(self, cache_dir: str | Path):
        self.cache_dir = Path(cache_dir)
        manifest_path = self.cache_dir / MANIFEST
        if not manifest_path.exists():
            raise SpecftError(f"cache: no {MANIFEST} in {self.cache_dir}; run `specft cache` first")
        self.manifest = read_json(manifest_path)
        try:
            self._index()
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            # a manifest edited by hand or by another version: fields of other types
            # (the fuzz suite found these, tests/test_fuzz.py)
            message = first_line(err)
            raise SpecftError(f"cache: {manifest_path} is damaged ({type(err).__name__}: {message}); delete "
                              f"{self.cache_dir} and run `specft cache` to rebuild it") from None
        self._open = lru_cache(maxsize=8)(self._open_shard)

    def _index(self) -> None:
        if not isinstance(self.manifest, dict) or not self.manifest.get("complete"):
            raise SpecftError(f"cache: {self.cache_dir} is incomplete; rerun `specft cache` to finish it")
        require_intact(self.cache_dir, self.manifest)  # sizes of all files, checksums of a sample
        require_unique_samples(self.cache_dir, self.manifest["shards"])
        self._where: dict[int, tuple[str, int]] = {}
        for shard in self.manifest["shards"]:
            for local, global_index in enumerate(shard["sample_index"]):
                self._where[int(global_index)] = (str(shard["file"]), local)
        self.indices = sorted(self._where)

    def for_epoch(self, epoch: int) -> CacheReader:
        """The samples a step of ``epoch`` reads: a cache holds one set for every epoch."""
        return self

    def shard_of(self, i: int) -> str:
        """The shard file that holds sample ``i`` (an index into this reader)."""
        return self._where[self.indices[i]][0]

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def hidden_size(self) -> int:
        return self.manifest["hidden_size"]

    def _open_shard(self, file: str):
        f = safe_open(str(self.cache_dir / file), framework="pt")
        return f, set(f.keys())

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        file, local = self._where[self.indices[i]]
        f, keys = self._open(file)
        offsets = f.get_slice("offsets")[local: local + 2]
        a, b = int(offsets[0]), int(offsets[1])
        return {
            "input_ids": f.get_slice("input_ids")[a:b].long(),
            "loss_mask": f.get_slice("loss_mask")[a:b].float(),
            "aux_hidden": self._hidden(f, keys, "aux_hidden", a, b),
            "final_hidden": self._hidden(f, keys, "final_hidden", a, b),
        }

    @staticmethod
    def _hidden(f, keys: set, name: str, a: int, b: int) -> torch.Tensor:
        scale_name = name + SCALE_SUFFIX
        scale = f.get_slice(scale_name)[a:b] if scale_name in keys else None
        return decode(f.get_slice(name)[a:b], scale)

    def target_head(self) -> dict[str, torch.Tensor]:
        tensors = load_file(str(self.cache_dir / TARGET_HEAD))
        tensors.setdefault("embed_tokens", tensors["lm_head"])  # tied embeddings
        return tensors

    def target_embedding(self) -> torch.Tensor:
        """The target's input embedding alone (the head's rows when they are tied)."""
        with safe_open(str(self.cache_dir / TARGET_HEAD), framework="pt") as f:
            return f.get_tensor("embed_tokens" if "embed_tokens" in f.keys() else "lm_head")

    def target_head_vocab(self) -> int:
        with safe_open(str(self.cache_dir / TARGET_HEAD), framework="pt") as f:
            return f.get_slice("lm_head").get_shape()[0]

    def target_head_rows(self, start: int, stop: int) -> torch.Tensor:
        """lm_head rows [start, stop), read from disk without the rest of the head."""
        with safe_open(str(self.cache_dir / TARGET_HEAD), framework="pt") as f:
            return f.get_slice("lm_head")[start:stop]

    def target_head_rows_at(self, ids: torch.Tensor) -> torch.Tensor:
        """lm_head rows ``ids`` in that order (the draft vocabulary's), read one by one:
        32k rows take about a second, and the head never loads whole."""
        with safe_open(str(self.cache_dir / TARGET_HEAD), framework="pt") as f:
            rows = f.get_slice("lm_head")
            return torch.stack([rows[i: i + 1][0] for i in ids.tolist()])

    def token_counts(self) -> torch.Tensor:
        return load_file(str(self.cache_dir / TOKEN_COUNTS))["counts"]


class SourcesReader:
    """Several readers read as one, each named by its source (the held-out caches of a
    mix, one per member): index i runs through the first reader, then the next."""

    def __init__(self, readers: dict[str, CacheReader]):
        if not readers:
            raise SpecftError("cache: no caches to read")
        self.readers = readers
        self.sources = [source for source, reader in self.readers.items() for _ in range(len(reader))]
        self._local = [i for reader in self.readers.values() for i in range(len(reader))]
        self.collective = any(getattr(reader, "collective", False) for reader in readers.values())

    @classmethod
    def from_dirs(cls, cache_dirs: dict[str, str | Path]) -> SourcesReader:
        return cls({source: CacheReader(d) for source, d in cache_dirs.items()})

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.readers[self.sources[i]][self._local[i]]

    def token_counts(self) -> torch.Tensor:
        return sum(reader.token_counts() for reader in self.readers.values())
