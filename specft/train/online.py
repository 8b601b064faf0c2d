"""Online features (trainer.features=online): the served target runs inside stage 2 and
computes each sample's features when a step reads it; no cache is written.

At the brief's scale a hidden-state cache does not fit on disk (terabytes for tens of
thousands of samples), so the target computes the features inside training. The served
target is the one stage 1 would cache from (cache.serve_target: placed, quantized,
calibrated) and the features come from the same code (cache.writer.capture_samples), so a
step sees the same numbers online as from a float32 cache of the same samples. What is
kept on disk: the target's regenerated answers (small, resumable), under the run dir.

OnlineFeatures has the CacheReader interface the trainer reads (samples by index, the
target head, the answers' token counts, the manifest's facts), so the trainer does not
know which it has.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import torch

from specft.cache import ServedTarget, serve_target, served_samples
from specft.cache.reader import SourcesReader
from specft.cache.writer import answer_token_counts, capture_samples, target_head_tensors
from specft.common.errors import SpecftError
from specft.common.launch import barrier
from specft.config import RootConfig, aux_layer_ids
from specft.data import DataSummary, load_conversations
from specft.data import report as data_report
from specft.data.records import Conversation
from specft.data.regenerate import read_all_answers
from specft.engines import engine_for
from specft.target_model.loader import target_facts
from specft.target_model.sharding import editing

log = logging.getLogger(__name__)


class OnlineFeatures:
    """Index i -> dict(input_ids, loss_mask, aux_hidden, final_hidden) for the i-th usable
    sample, its features computed by the served target at batch 1 (no padding)."""

    # Features are checked when computed (capture_samples refuses NaN/Inf), so a failed
    # step never needs to look for bad inputs: under a sharded target that look would be
    # a forward on one rank only.
    checked_on_read = True

    def __init__(self, cfg: RootConfig, target: ServedTarget, samples: list, head: dict[str, torch.Tensor],
                 name: str, world_size: int = 1, resample=None):
        self.cfg, self.samples, self.head = cfg, samples, head
        # epoch -> that epoch's samples (trainer.regenerate_every_epoch); None: the same
        # samples every epoch. Only the current epoch's are kept besides epoch 0's.
        self._resample = resample
        self._epoch_views: dict[int, OnlineFeatures] = {}
        self.cache_dir = name  # what error lines name in place of a cache directory
        self.indices = [i for i, s in enumerate(samples) if s is not None]
        self.capture = engine_for("features", cfg.cache.engine).capture(cfg, target.model)
        self.pad_id = target.tokenizer.pad_token_id
        # A sharded target's forward is a collective: every rank must read as many samples.
        self.collective = target.placed.lockstep.enabled or target.placed.data_world < world_size
        self.manifest = {"aux_layer_ids": aux_layer_ids(cfg.model), "hidden_size": cfg.model.hidden_size,
                         "target": target_facts(cfg.model, target.model.config)}

    def __len__(self) -> int:
        return len(self.indices)

    def shard_of(self, i: int) -> str:
        return "online features"

    def for_epoch(self, epoch: int) -> OnlineFeatures:
        """The samples a step of ``epoch`` reads: the target's new answers for that epoch
        (computed on first use, at the same step on every rank), each sample whose new
        answer is unusable (over-length, empty) keeping epoch 0's."""
        if self._resample is None or epoch == 0:
            return self
        if epoch not in self._epoch_views:
            fresh = self._resample(epoch)
            view = copy.copy(self)
            view.samples = [new if new is not None else old for new, old in zip(fresh, self.samples)]
            self._epoch_views = {epoch: view}
        return self._epoch_views[epoch]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        index = self.indices[i]
        sample = self.samples[index]
        ((aux, final),) = capture_samples(self.capture, [sample], [index], self.pad_id, self.cfg)
        return {"input_ids": sample.input_ids.long(), "loss_mask": sample.loss_mask.float(),
                "aux_hidden": aux, "final_hidden": final}

    def target_head(self) -> dict[str, torch.Tensor]:
        return {"embed_tokens": self.target_embedding(), "lm_head": self.head["lm_head"]}

    def target_embedding(self) -> torch.Tensor:
        return self.head.get("embed_tokens", self.head["lm_head"])

    def target_head_vocab(self) -> int:
        return self.head["lm_head"].shape[0]

    def target_head_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.head["lm_head"][start:stop]

    def target_head_rows_at(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head["lm_head"][ids.long()]

    def token_counts(self) -> torch.Tensor:
        """Counts of loss-masked (answer) tokens over every sample, as a cache stores them."""
        vocab = self.target_head_vocab()
        counts = torch.zeros(vocab, dtype=torch.long)
        for i in self.indices:
            s = self.samples[i]
            counts += answer_token_counts(s.input_ids, s.loss_mask, vocab)
        return counts


def with_regenerate_seed(cfg: RootConfig, epoch: int) -> RootConfig:
    """``cfg`` whose regeneration samples epoch ``epoch``'s answers (its own seed)."""
    rc = cfg.data.regenerate
    data = dataclasses.replace(cfg.data, regenerate=dataclasses.replace(rc, seed=rc.seed + 1_000_003 * epoch))
    return dataclasses.replace(cfg, data=data)


def _every_slice(cfg: RootConfig, target: ServedTarget, convs: list[Conversation], name: str,
                 summary: DataSummary, world_size: int) -> list:
    """All samples on every rank: a step may read any of them. Regeneration answers this
    rank's slice into run_dir/online/<name>-<provenance hash> (named by what a cache of
    them would be named by: answers to other data or from another target are never
    resumed from); the others' answers are read from their stores once all are done."""
    from specft.provenance import provenance_hash
    from specft.provenance.build import build_provenance

    provenance = build_provenance(cfg, target.tokenizer)
    regen_dir = Path(cfg.run_dir) / "online" / f"{name}-{provenance_hash(provenance)}"
    samples = served_samples(cfg, target, convs, regen_dir, summary, provenance)
    if not cfg.data.regenerate.enabled or target.placed.data_world == 1:
        return samples
    from specft.data import tokenize_all

    barrier(world_size)
    answered = read_all_answers(regen_dir, convs, target.placed.data_world, cfg.data)
    return tokenize_all(answered, target.tokenizer, cfg.data, DataSummary())


def online_readers(cfg: RootConfig, rank: int, world_size: int,
                   heldout: dict[str, RootConfig] | None = None) -> tuple[OnlineFeatures, SourcesReader | None]:
    """The training features and (trainer.val_data=heldout) the held-out sides', all
    computed by one served target loaded here."""
    from specft.target_model import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    summary = DataSummary()
    convs = load_conversations(cfg.data, summary)
    target = serve_target(cfg, rank, world_size, convs, tokenizer)
    head = target_head_tensors(target.model, editing(target.placed))  # a collective when sharded
    samples = _every_slice(cfg, target, convs, "train", summary, world_size)
    data_report(summary)
    resample = None
    if cfg.trainer.regenerate_every_epoch:
        def resample(epoch: int) -> list:
            epoch_cfg = with_regenerate_seed(cfg, epoch)
            log.info("online features: epoch %d, the target answers the %d prompts again", epoch, len(convs))
            return _every_slice(epoch_cfg, target, convs, "train", DataSummary(), world_size)
    train = OnlineFeatures(cfg, target, samples, head, "online features (training data)", world_size, resample)
    if not len(train):
        raise SpecftError(f"trainer.features=online: no usable samples; {summary.line()}")
    log.info("online features: %d samples, %d tokens; the target computes them as training reads them",
             len(train), sum(len(samples[i].input_ids) for i in train.indices))
    if not heldout:
        return train, None
    sides = {}
    for source, side in heldout.items():
        log.info("validation (%s): up to %d held-out conversations, answers by the target",
                 source, cfg.trainer.val_samples)
        side_summary = DataSummary()
        side_convs = load_conversations(side.data, side_summary)
        side_samples = _every_slice(side, target, side_convs, f"heldout-{source}", side_summary, world_size)
        sides[source] = OnlineFeatures(side, target, side_samples, head, f"online features (held-out {source})",
                                       world_size)
    return train, SourcesReader(sides)
