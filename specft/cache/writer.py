"""Stage 1: run the (quantized) target over the data and write the hidden-state cache.

Each rank takes samples i with i % world_size == rank, in shards of
``samples_per_shard``; every shard is written to a temporary name and moved into place,
then the rank's progress file is updated atomically. A rerun skips finished shards, so
an interrupted run resumes where it stopped. Rank 0 merges the progress files into
manifest.json once all ranks are done.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specft.cache.integrity import file_record
from specft.cache.manifest import MANIFEST, atomic_write_json, check_provenance, read_json
from specft.cache.storage import bytes_per_token, encode
from specft.common.disk import disk_full_line, format_bytes, is_disk_full
from specft.common.errors import SpecftError
from specft.common.progress import progress_bar
from specft.config import RootConfig, aux_layer_ids
from specft.data import Sample
from specft.provenance import CACHE_VERSION, provenance_hash

log = logging.getLogger(__name__)

TARGET_HEAD = "target_head.safetensors"
TOKEN_COUNTS = "token_counts.safetensors"


def resolve_cache_dir(cfg: RootConfig, provenance: dict) -> Path:
    if cfg.cache.dir:
        return Path(cfg.cache.dir).expanduser().resolve()
    name = f"{cfg.model.name}-{cfg.quant.name}-{provenance_hash(provenance)}"
    return (Path(cfg.cache.root).expanduser() / name).resolve()


def answered_cache_provenance(cfg: RootConfig, provenance: dict, unreachable: SpecftError) -> dict:
    """The provenance of the one finished cache of this config whose answers came from a
    engine that does not answer now (a server that is down): reading a finished cache
    needs no answers, only their identity, which its manifest keeps. ``provenance``: this
    config's, less that identity. Anything else re-raises ``unreachable``."""
    if cfg.cache.dir:
        candidates = [Path(cfg.cache.dir).expanduser() / MANIFEST]
    else:
        candidates = sorted(Path(cfg.cache.root).expanduser().glob(f"{cfg.model.name}-{cfg.quant.name}-*/{MANIFEST}"))
    found = []
    for path in candidates:
        stored = read_json(path) if path.exists() else {}
        theirs = stored.get("provenance", {})
        if stored.get("complete") and "answers" in theirs and \
                {k: v for k, v in theirs.items() if k != "answers"} == provenance:
            found.append(theirs)
    if len(found) != 1:
        if found:
            names = ", ".join(str(p["answers"].get("model")) for p in found)
            raise SpecftError(f"{unreachable}; {len(found)} finished caches of this config were answered by "
                              f"servers ({names}): start the one whose answers you mean") from None
        raise unreachable
    log.info("cache: the answers' server does not answer; reading the finished cache it answered (%s)",
             found[0]["answers"].get("model"))
    return found[0]


def shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank:03d}-{index:06d}.safetensors"


def progress_path(cache_dir: Path, rank: int) -> Path:
    return cache_dir / f"progress-r{rank:03d}.json"


def cache_is_complete(cache_dir: Path, provenance: dict) -> bool:
    """True when a finished cache for exactly these inputs exists; raises when the
    directory holds a cache built from other inputs."""
    for path in [cache_dir / MANIFEST, *sorted(cache_dir.glob("progress-r*.json"))]:
        if path.exists():
            check_provenance(cache_dir, read_json(path)["provenance"], provenance)
    manifest = cache_dir / MANIFEST
    return manifest.exists() and read_json(manifest).get("complete", False)


def _pad_batch(samples: list[Sample], pad_id: int):
    length = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), length), dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s.input_ids)] = s.input_ids
        attn[row, : len(s.input_ids)] = 1
    return ids, attn


def capture_samples(capture, batch: list[Sample], indices: list[int], pad_id: int,
                    cfg: RootConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(aux [T, 3H], final [T, H]) in float32 for each sample of ``batch`` (global sample
    numbers ``indices``), from one padded forward of the target: what stage 1 stores and
    what online training (train/online.py) computes, by the same code."""
    ids, attn = _pad_batch(batch, pad_id)
    aux, final = capture(ids, attn)
    out = []
    for row, (index, s) in enumerate(zip(indices, batch)):
        n = len(s.input_ids)
        out.append((aux[row, :n].float(), final[row, :n].float()))
        require_finite(*out[-1], index, cfg)
    return out


def require_finite(aux: torch.Tensor, final: torch.Tensor, index: int, cfg: RootConfig) -> None:
    """Features never hold NaN/Inf: stage 2 would train on them, or stop far from the
    cause. Refused before a cache shard is written (finished shards stay) or a step runs."""
    if torch.isfinite(aux).all() and torch.isfinite(final).all():
        return
    raise SpecftError(f"cache: the target's hidden states for sample {index} are not finite (NaN/Inf) under "
                      f"quant={cfg.quant.name}, model.dtype={cfg.model.dtype}; nothing was stored for "
                      "it. A wider dtype (model.dtype=float32) or another quant config avoids an overflow")


class CacheWriter:
    """Writes one data slice's shards. ``rank``/``world_size`` name the slice (the data
    parallel rank: under tensor parallelism a group of ranks shares one); ``writes`` is
    false on the group's other ranks, which compute the same batches but save nothing;
    ``lockstep`` pads this rank's forwards to the busiest rank's count (ZeRO-3)."""

    def __init__(self, cfg: RootConfig, cache_dir: Path, provenance: dict,
                 rank: int = 0, world_size: int = 1, writes: bool = True, lockstep=None):
        from specft.target_model.sharding import Lockstep

        self.cfg, self.cache_dir, self.provenance = cfg, cache_dir, provenance
        self.rank, self.world_size, self.writes = rank, world_size, writes
        self.lockstep = lockstep or Lockstep(False)

    def _my_shards(self, samples: list[Sample | None], per: int) -> list[list[int]]:
        mine = [i for i in range(self.rank, len(samples), self.world_size) if samples[i] is not None]
        return [mine[i: i + per] for i in range(0, len(mine), per)]

    def _shard_size(self, progress: dict) -> int:
        """Samples per shard: the cache's own, once it has shards. cache.samples_per_shard
        is not part of the cache key (it changes no sample), so a repair or resume may
        run with another value; shard j must still hold the samples it was planned with,
        or a rebuilt shard would miss or repeat samples."""
        wanted = self.cfg.cache.samples_per_shard
        stored = progress.get("samples_per_shard")
        if stored is None and progress["shards"]:  # caches from before the layout was recorded
            stored = max(s["num_samples"] for s in progress["shards"])
        if stored is not None and stored != wanted:
            log.info("cache: %s was laid out with %d samples per shard; finishing it with that "
                     "(cache.samples_per_shard=%d applies to new caches)", self.cache_dir, stored, wanted)
        return stored or wanted

    def _check_layout(self, progress: dict, shards: list[list[int]]) -> None:
        """Every recorded shard holds exactly the samples this layout puts there."""
        for s in progress["shards"]:
            j = int(s["file"].rsplit("-", 1)[1].split(".")[0])
            if j >= len(shards) or s["sample_index"] != shards[j]:
                raise SpecftError(f"cache: {self.cache_dir / s['file']} holds other samples than this run "
                                  f"lays out for it; delete {self.cache_dir} to rebuild the cache")

    def _load_progress(self) -> dict:
        path = progress_path(self.cache_dir, self.rank)
        if path.exists():
            progress = read_json(path)
            check_provenance(self.cache_dir, progress["provenance"], self.provenance)
            if progress["world_size"] != self.world_size:
                raise SpecftError(f"cache at {self.cache_dir} was started with {progress['world_size']} "
                                  f"ranks; finish it with trainer.nproc={progress['world_size']} "
                                  f"or delete it")
            # Trust only shards whose file exists (the progress file is written after it).
            progress["shards"] = [s for s in progress["shards"] if (self.cache_dir / s["file"]).exists()]
            return progress
        return {"provenance": self.provenance, "rank": self.rank, "world_size": self.world_size,
                "samples_per_shard": self.cfg.cache.samples_per_shard, "shards": []}

    def estimate_bytes(self, samples: list[Sample | None]) -> int:
        """What the shards of ``samples`` take on disk: per token, the stored hidden
        values of every cached layer (aux layers and the final one, scales included),
        the token id (int32) and loss mask (uint8); per sample, two int64 indices."""
        tokens = sum(len(s.input_ids) for s in samples if s is not None)
        count = sum(s is not None for s in samples)
        groups = len(aux_layer_ids(self.cfg.model)) + 1
        per_token = bytes_per_token(self.cfg.cache.dtype, self.cfg.model.hidden_size, groups) + 5
        return tokens * per_token + count * 16

    def _check_disk(self, samples: list[Sample | None]) -> None:
        need = self.estimate_bytes(samples)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.cache_dir).free
        log.info("cache: %d samples to write, ~%s on disk (%s free) at %s",
                 sum(s is not None for s in samples), format_bytes(need), format_bytes(free), self.cache_dir)
        if need > free:
            raise SpecftError(f"cache: needs ~{format_bytes(need)} but only {format_bytes(free)} is free at "
                              f"{self.cache_dir}; free some space or set cache.root elsewhere (cache.dtype=fp8 "
                              "takes about half of bf16)")

    def _compute_shard(self, capture, samples: list[Sample], indices: list[int], pad_id: int,
                       bar) -> dict[str, torch.Tensor]:
        aux_parts, final_parts = [None] * len(indices), [None] * len(indices)
        bs = self.cfg.cache.batch_size
        # Batches of similar lengths: padding every row to its batch's longest was 18% of
        # the tokens computed for 400 regenerated GSM8K samples at batch 8, 5% sorted. The
        # shard keeps its sample order.
        by_length = sorted(range(len(indices)), key=lambda j: len(samples[indices[j]].input_ids))
        for start in range(0, len(by_length), bs):
            slots = by_length[start: start + bs]
            self.lockstep.step(True)
            features = capture_samples(capture, [samples[indices[j]] for j in slots],
                                       [indices[j] for j in slots], pad_id, self.cfg)
            for j, (aux, final) in zip(slots, features):
                aux_parts[j], final_parts[j] = aux, final
            bar.update(sum(len(samples[indices[j]].input_ids) for j in slots))
        lengths = torch.tensor([len(samples[i].input_ids) for i in indices])
        return {
            "input_ids": torch.cat([samples[i].input_ids for i in indices]).to(torch.int32),
            "loss_mask": torch.cat([samples[i].loss_mask for i in indices]),
            **encode("aux_hidden", torch.cat(aux_parts), len(aux_layer_ids(self.cfg.model)), self.cfg.cache.dtype),
            **encode("final_hidden", torch.cat(final_parts), 1, self.cfg.cache.dtype),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            "sample_index": torch.tensor(indices, dtype=torch.long),
        }

    def _save_shard(self, tensors: dict[str, torch.Tensor], file: str, progress: dict) -> None:
        """Write one shard (temp name, then rename) and record it in the progress file.
        Runs on the writer thread; shards are saved one at a time, in order."""
        fd, tmp = tempfile.mkstemp(prefix=f".{file}.", dir=self.cache_dir)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"provenance_hash": provenance_hash(self.provenance)})
        except Exception as err:
            Path(tmp).unlink(missing_ok=True)  # a partial shard only takes space
            if is_disk_full(err):
                done = len(progress["shards"])
                raise SpecftError("cache: " + disk_full_line(
                    f"{self.cache_dir / file}", f"the {done} shard(s) finished before it are kept "
                    f"(rank {self.rank})", "rerun the same command: it computes only the rest")) from None
            raise
        record = file_record(Path(tmp))  # size and checksum, verified when the cache is opened
        os.replace(tmp, self.cache_dir / file)
        offsets = tensors["offsets"]
        indices = tensors["sample_index"].tolist()
        progress["shards"].append({"file": file, "num_samples": len(indices),
                                   "num_tokens": int(offsets[-1]), "sample_index": indices, **record})
        atomic_write_json(progress_path(self.cache_dir, self.rank), progress)

    def _remove_stale_temporaries(self) -> None:
        """A killed run can leave this rank's half-written shard temporaries behind."""
        for tmp in self.cache_dir.glob(f".shard-r{self.rank:03d}-*"):
            tmp.unlink(missing_ok=True)

    def write(self, capture, samples: list[Sample | None], pad_id: int) -> None:
        try:
            self._write(capture, samples, pad_id)
        finally:  # a rank out of work keeps joining the others' gathers until all are done
            one = torch.full((1, 1), pad_id, dtype=torch.long)
            self.lockstep.drain(lambda: capture(one, torch.ones_like(one)))

    def _write(self, capture, samples: list[Sample | None], pad_id: int) -> None:
        if self.cache_dir.exists() and self.writes:
            self._remove_stale_temporaries()
        progress = self._load_progress()
        progress["samples_per_shard"] = self._shard_size(progress)
        done = {s["file"] for s in progress["shards"]}
        shards = self._my_shards(samples, progress["samples_per_shard"])
        self._check_layout(progress, shards)
        pending = [(j, idx) for j, idx in enumerate(shards) if shard_name(self.rank, j) not in done]
        if not pending:
            if self.writes and not progress_path(self.cache_dir, self.rank).exists():  # no samples
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_json(progress_path(self.cache_dir, self.rank), progress)
            return
        if self.rank == 0 and self.writes:
            self._check_disk([samples[i] for _, idx in pending for i in idx])
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        total = sum(len(samples[i].input_ids) for _, idx in pending for i in idx)
        t0 = time.perf_counter()
        # The target computes shard j+1 while a writer thread saves shard j: disk time
        # hides behind compute (at most one shard waits in memory).
        with progress_bar(total, f"cache r{self.rank}", "tok") as bar, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-writer") as pool:
            saving = None
            for j, idx in pending:
                tensors = self._compute_shard(capture, samples, idx, pad_id, bar)
                if saving is not None:
                    saving.result()
                if self.writes:
                    saving = pool.submit(self._save_shard, tensors, shard_name(self.rank, j), progress)
            if saving is not None:
                saving.result()
        log.info("cache r%d: %d tokens in %.1fs", self.rank, total, time.perf_counter() - t0)


def target_head_tensors(model, edit) -> dict[str, torch.Tensor]:
    """The target's (quantized, as deployed) lm_head and embedding, whole. Every rank
    calls this: gathering a sharded weight is a collective."""
    head_param = model.get_output_embeddings().weight
    emb_param = model.get_input_embeddings().weight
    tensors = {}
    for name, param in (("lm_head", head_param), ("embed_tokens", emb_param)):
        if name == "embed_tokens" and param is head_param:
            break  # tied: stage 2 reads the head
        with torch.no_grad(), edit(param) as full:
            tensors[name] = full.detach().clone().contiguous()
    return tensors


def answer_token_counts(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Counts [vocab] of the loss-masked (answer) tokens: what the draft vocabulary is built
    from, for a cache's shards and online samples alike."""
    ids = input_ids.long()[loss_mask.bool()]
    return torch.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab)


def save_side_files(cache_dir: Path, head: dict[str, torch.Tensor], world_size: int) -> None:
    """The target head tensors, which stage 2 needs to recompute target logits and to
    embed tokens, and the counts of loss-masked tokens over every shard (what was cached,
    regenerated answers included), from which stage 2 builds the draft vocabulary."""
    save_file(head, str(cache_dir / TARGET_HEAD))
    vocab = head["lm_head"].shape[0]
    counts = torch.zeros(vocab, dtype=torch.long)
    for rank in range(world_size):
        for shard in read_json(progress_path(cache_dir, rank))["shards"]:
            with safe_open(str(cache_dir / shard["file"]), framework="pt") as f:
                counts += answer_token_counts(f.get_tensor("input_ids"), f.get_tensor("loss_mask"), vocab)
    save_file({"counts": counts}, str(cache_dir / TOKEN_COUNTS))


def require_unique_samples(cache_dir: Path, shards: list[dict]) -> None:
    """No sample in two shards: a cache that repeats samples trains on the wrong data."""
    seen: dict[int, str] = {}
    for shard in shards:
        for index in shard["sample_index"]:
            if index in seen:
                raise SpecftError(f"cache: sample {index} is in both {seen[index]} and {shard['file']} "
                                  f"in {cache_dir}; delete {cache_dir} to rebuild the cache")
            seen[index] = shard["file"]


def merge_manifest(cfg: RootConfig, cache_dir: Path, provenance: dict, world_size: int,
                   target: dict, data_summary: dict | None = None) -> dict:
    shards = []
    for rank in range(world_size):
        shards.extend(read_json(progress_path(cache_dir, rank))["shards"])
    require_unique_samples(cache_dir, shards)
    manifest = {
        "version": CACHE_VERSION, "provenance": provenance,
        "provenance_hash": provenance_hash(provenance), "complete": True,
        "hidden_size": cfg.model.hidden_size, "aux_layer_ids": aux_layer_ids(cfg.model),
        "dtype": cfg.cache.dtype, "world_size": world_size, "target": target,
        "data_summary": data_summary or {},
        "num_samples": sum(s["num_samples"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "shards": sorted(shards, key=lambda s: s["file"]),
        "files": {name: file_record(cache_dir / name) for name in (TARGET_HEAD, TOKEN_COUNTS)
                  if (cache_dir / name).exists()},
    }
    atomic_write_json(cache_dir / MANIFEST, manifest)
    return manifest
