"""Stage 2: train the draft head on the cache with a DeepSpeed engine."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specft.cache import CacheReader, SourcesReader
from specft.common.errors import SpecftError
from specft.config import RootConfig
from specft.decoding.engine import RoundCounts
from specft.device import select_device
from specft.drafts import DRAFT_ARCHS, DraftHeadConfig, build_draft_vocab
from specft.drafts.qat import apply_draft_qat
from specft.drafts.vocab import coverage
from specft.eval.stats import confidence
from specft.export.rotation_fold import fold_into_eagle3
from specft.export.verifier import VERIFIER_KEYS
from specft.quant.config import load_quant_config
from specft.target_model.rotation_source import ROTATED, served_rotation, target_basis
from specft.train.batches import StepSampler, collate
from specft.train.checkpoint import (
    consolidated_state,
    latest_tag,
    load_checkpoint,
    save_checkpoint,
    save_final,
    step_tags,
)
from specft.train.losses import MixtureLoss
from specft.train.metrics import MetricsLogger
from specft.train.objective import StepResult, acceptance_length, target_view, ttt_objective
from specft.train.replay import replay_sample, step_hits
from specft.train.schedule import warmup_cosine
from specft.train.target_head import load_target_head
from specft.train.unrotate import unrotated
from specft.train.vocab_prior import target_prior

log = logging.getLogger(__name__)
CONSOLE_EVERY = 10  # steps between console lines; metrics.jsonl gets every log_every


def draft_vocab(cfg: RootConfig, reader: CacheReader, heldout: SourcesReader | None = None):
    """The draft vocabulary from the training answers' token counts (and the target's
    prior for free slots, draft.vocab_fill=prior); coverage logged, held-out too."""
    counts = reader.token_counts()
    seen = int((counts > 0).sum())
    prior = None
    if cfg.draft.vocab_fill == "prior" and cfg.draft.vocab_size > seen:
        prior = target_prior(reader, seed=cfg.seed, vocab_chunk=cfg.trainer.vocab_chunk)
    vocab = build_draft_vocab(counts, cfg.draft.vocab_size, prior=prior)
    held = f"; {100 * coverage(vocab.t2d, heldout.token_counts()):.1f}% of held-out ones" if heldout else ""
    log.info("draft vocab: %d tokens (%d seen in training answers%s) cover %.1f%% of training answer tokens%s",
             vocab.size, min(seen, vocab.size), ", the rest by the target's prior" if prior is not None else "",
             100 * vocab.coverage, held)
    return vocab


def build_draft(cfg: RootConfig, reader: CacheReader, heldout: SourcesReader | None = None):
    target = reader.manifest["target"]
    vocab = draft_vocab(cfg, reader, heldout)
    qk_norm = cfg.draft.qk_norm if cfg.draft.qk_norm is not None else target["family"].startswith("qwen3")
    d = cfg.draft
    heads = d.num_heads or target["num_heads"]
    # A custom head count without a kv count means plain multi-head attention.
    kv_heads = d.num_kv_heads or (target["num_kv_heads"] if not d.num_heads else heads)
    arch = DRAFT_ARCHS.get(cfg.draft.name, "draft.name")
    c = DraftHeadConfig(
        hidden_size=d.hidden_size or cfg.model.hidden_size, target_hidden_size=cfg.model.hidden_size,
        num_heads=heads, num_kv_heads=kv_heads,
        head_dim=d.head_dim or target["head_dim"], num_layers=d.num_layers,
        intermediate_size=cfg.draft.intermediate_size or target["intermediate_size"],
        target_vocab_size=target["vocab_size"], draft_vocab_size=vocab.size,
        rope_theta=target["rope_theta"], rms_norm_eps=target["rms_norm_eps"], qk_norm=qk_norm,
        num_aux_layers=len(reader.manifest["aux_layer_ids"]),
        options=arch.options(d, cfg.model) if arch.options is not None else {},
        max_draft_tokens=arch.max_draft_tokens(d) if arch.max_draft_tokens is not None else None)
    draft_rows = reader.target_head_rows_at(vocab.draft_to_target)
    head = {"embed_tokens": reader.target_embedding(), "draft_rows": draft_rows}
    draft = arch.build(c, head, vocab)
    if cfg.draft.init == "target_layer":
        from specft.drafts.init import load_target_layer

        copied = arch.init_from_layer(draft, load_target_layer(cfg.model, cfg.draft.init_layer))
        log.info("draft init: %d tensors from the target's decoder layer %s", len(copied),
                 "last" if cfg.draft.init_layer is None else cfg.draft.init_layer)
    if cfg.draft.quant is not None:
        switched = apply_draft_qat(draft, load_quant_config(cfg.draft.quant, "draft.quant"))
        log.info("draft QAT (%s): %d linear layers", cfg.draft.quant, len(switched))
    return draft, draft_rows


def _ds_config(cfg: RootConfig) -> dict:
    t = cfg.trainer
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def _make_engine(cfg: RootConfig, draft):
    import deepspeed

    t = cfg.trainer
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, t.warmup_steps, t.max_steps, t.min_lr_ratio))
    engine, _, _, _ = deepspeed.initialize(model=draft, optimizer=opt, lr_scheduler=sched,
                                           config=_ds_config(cfg))
    return engine


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, validation) sample positions: a seeded choice of round(n * fraction)
    samples (at least one when the fraction is positive) is held out."""
    n_val = max(1, round(n * val_fraction)) if val_fraction > 0 and n > 1 else 0
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 7919)).tolist()
    val = sorted(perm[:n_val])
    held = set(val)
    return [i for i in range(n) if i not in held], val


def _mean_across_ranks(values: list[float], world_size: int) -> list[float]:
    if world_size == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return (t / world_size).tolist()


def _replay_record(per_prompt: list[list[int]], k: int, seed: int, prefix: str = "") -> dict:
    """Replayed acceptance at k from per-prompt [rounds, proposed, accepted], with the same
    bootstrap CI over prompts as specft eval's; keys start with ``prefix``."""
    total = RoundCounts(*(sum(col) for col in zip(*per_prompt))) if per_prompt else RoundCounts()
    record = {f"{prefix}replay_accept_rate_k{k}": total.acceptance_rate,
              f"{prefix}replay_accept_len_k{k}": total.acceptance_length,
              f"{prefix}replay_per_prompt_k{k}": per_prompt}
    if per_prompt:
        record[f"{prefix}replay_accept_rate_ci_k{k}"] = confidence(per_prompt, seed)["acceptance_rate_ci"]
    return record


def _gather_lists(values: list, world_size: int) -> list:
    """Every rank's list, concatenated in rank order."""
    if world_size == 1:
        return values
    parts = [None] * world_size
    torch.distributed.all_gather_object(parts, values)
    return [v for part in parts for v in part]


def _sum_across_ranks(value: int, world_size: int) -> int:
    if world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.long)
    torch.distributed.all_reduce(t)
    return int(t.item())


def _replay_line(val: dict) -> str:
    """'; replayed decoding: k=3 acceptance 0.312 (length 1.94; gsm8k 0.298; sharegpt
    0.331), ...' from a val record (per source when validation read several)."""
    ks = [int(key.rsplit("k", 1)[1]) for key in val if key.startswith("replay_accept_rate_k")]
    parts = []
    for k in ks:
        by_source = [f"{key.split('/')[0]} {rate:.3f}" for key, rate in val.items()
                     if key.endswith(f"/replay_accept_rate_k{k}")]
        parts.append(f"k={k} acceptance {val[f'replay_accept_rate_k{k}']:.3f} (length "
                     f"{val[f'replay_accept_len_k{k}']:.2f}{''.join('; ' + b for b in by_source)})")
    return "; replayed decoding: " + ", ".join(parts) if parts else ""


class Trainer:
    """Trains the draft on the features ``reader`` gives: a CacheReader (stage 1's cache)
    or train/online.py's OnlineFeatures (the target computes them as steps read them).
    ``val_reader``: the held-out sides (trainer.val_data=heldout), else a split of ``reader``."""

    def __init__(self, cfg: RootConfig, reader, rank: int = 0, world_size: int = 1,
                 mix_reader: CacheReader | None = None, val_reader: SourcesReader | None = None):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.reader, self.mix_reader = reader, mix_reader
        if self.mix_reader is not None and len(self.mix_reader) != len(self.reader):
            raise SpecftError(f"trainer.mix_quant: caches differ in samples ({len(self.reader)} vs "
                              f"{len(self.mix_reader)})")
        # Subnormal floats run ~100x slower on CPUs; as the draft trains, attention and
        # optimizer states produce them and steps crawl. Flushing them costs no accuracy
        # that matters for training.
        torch.set_flush_denormal(True)
        torch.manual_seed(cfg.seed)
        self.rotation = None
        if cfg.trainer.unrotate is not None:  # train in the unrotated basis, write folded drafts
            self.rotation = served_rotation(cfg)
            self.reader, val_reader = unrotated(self.reader, self.rotation[0]), unrotated(val_reader, self.rotation[0])
        self.val_reader, heldout = self.reader, None
        if val_reader is not None:  # trainer.val_data=heldout: every training sample trains
            self.val_reader = heldout = val_reader
            self.train_idx, self.val_idx = list(range(len(self.reader))), list(range(len(self.val_reader)))
        else:
            self.train_idx, self.val_idx = split_indices(len(self.reader), cfg.trainer.val_fraction, cfg.seed)
        draft, draft_rows = build_draft(cfg, self.reader, heldout)
        # Stored dtype: target_view computes chunks in fp32.
        self.head = load_target_head(self.reader, cfg.trainer.target_head, draft_rows, rank, world_size)
        if rank == 0:
            log.info("target head: %s, %d of %d rows per rank (%.1f MB)", cfg.trainer.target_head,
                     self.head.rows.shape[0], self.head.vocab_size,
                     self.head.rows.numel() * self.head.rows.element_size() / 2**20)
        self.engine = _make_engine(cfg, draft)
        self.loss_fn = MixtureLoss(cfg.loss.terms or {cfg.loss.name: 1.0})
        self._loss_label = " + ".join(cfg.loss.terms or [cfg.loss.name])
        # Validation unrolls the draft as far as the deepest k it replays, past the steps it
        # trains: a TTT-3 draft still reports its acceptance at eval's k = 4, 5.
        self.replay_k = list(cfg.eval.k)
        self.val_steps = max([cfg.draft.ttt_steps, *self.replay_k])
        self.sampler = StepSampler(len(self.train_idx), cfg.seed, cfg.trainer.micro_batch_size,
                                   cfg.trainer.grad_accum, rank, world_size)
        self.run_config_yaml = (self.run_dir / "config.yaml").read_text()
        self.extra_config = {"architecture": cfg.draft.name, "target_model": cfg.model.name,
                             "quant": cfg.quant.name, "draft_quant": cfg.draft.quant,
                             "aux_layer_ids": self.reader.manifest["aux_layer_ids"],
                             "target_hidden_size": cfg.model.hidden_size,
                             # caches built before these facts were recorded lack them: export then reads the run config
                             "verifier": {k: v for k, v in self.reader.manifest["target"].items()
                                          if k in VERIFIER_KEYS and v is not None}}
        # the basis the draft files read (trainer.unrotate trains unrotated, then folds R1 in)
        self.extra_config["basis"] = ROTATED if self.rotation is not None else target_basis(cfg.quant, cfg.model.path)
        if self.rotation is not None:
            self.extra_config["rotation"] = {**self.rotation[1], "trained": "unrotated"}

    def _served(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state the draft files hold: folded for the rotated target under trainer.unrotate."""
        if self.rotation is None:
            return state
        meta = {"hidden_size": self.engine.module.config.hidden_size,
                "target_hidden_size": self.cfg.model.hidden_size}
        return fold_into_eagle3(state, meta, self.rotation[0])

    def _resume(self) -> int:
        """The step to start from: the latest checkpoint's, or an older one's when the
        latest cannot be read (a truncated DeepSpeed state), named in a warning."""
        tag = latest_tag(self.ckpt_root) if self.cfg.trainer.resume else None
        if tag is None:
            return 0
        tags = [tag] + [t for t in step_tags(self.ckpt_root) if t < tag]
        for i, candidate in enumerate(tags):
            try:
                step = load_checkpoint(self.engine, self.ckpt_root, candidate, self.rank)
            except Exception as err:  # DeepSpeed / torch.load raise many kinds on a damaged file
                log.warning("checkpoints: %s cannot be loaded (%s: %s)%s", self.ckpt_root / candidate,
                            type(err).__name__, str(err).splitlines()[0][:120] if str(err) else "",
                            "; trying the previous one" if i + 1 < len(tags) else "")
                continue
            log.info("resumed from %s (step %d)", self.ckpt_root / candidate, step)
            return step
        raise SpecftError(f"trainer.resume: no checkpoint in {self.ckpt_root} can be loaded; "
                          "trainer.resume=false trains from scratch")

    def _fetch(self, index: int, step: int | None) -> dict:
        """One cached sample; while training with trainer.mix_quant, a seeded share of
        samples come from the other target's cache (same tokens, other features)."""
        t = self.cfg.trainer
        if step is None:
            return self.val_reader[index]
        if self.mix_reader is not None:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 65_537 + index)
            if torch.rand((), generator=g).item() < t.mix_fraction:
                return self.mix_reader[index]
        return self.reader.for_epoch(self.sampler.epoch_of_step(step))[index]

    def _forward(self, indices: list[int], step: int | None = None) -> tuple[StepResult, int]:
        """``step`` is set while training (mixing and noise apply), None in validation."""
        batch = collate([self._fetch(i, step) for i in indices])
        noise = self.cfg.trainer.feature_noise
        if step is not None and noise > 0:
            for key in ("aux_hidden", "final_hidden"):
                x = batch[key]
                rms = x.pow(2).mean(-1, keepdim=True).sqrt()
                batch[key + "_input"] = x + noise * rms * torch.randn_like(x)
        return self._forward_batch(batch, validating=step is None)

    def _forward_batch(self, batch: dict, validating: bool = False) -> tuple[StepResult, int]:
        draft = self.engine.module
        view = target_view(batch, self.head, draft.t2d, self.cfg.trainer.vocab_chunk)
        # Noise perturbs what the draft reads, never the target it is scored against.
        steps = self.val_steps if validating else self.cfg.draft.ttt_steps
        with self._autocast():  # the objective computes its losses in float32 either way
            out = self.engine(batch["input_ids"], batch.get("aux_hidden_input", batch["aux_hidden"]),
                              batch.get("final_hidden_input", batch["final_hidden"]), steps)
        res = ttt_objective(out.logits, view, draft.draft_to_target, self.loss_fn, self._step_weights(steps),
                            out.hidden, keep_hits=validating, on_policy=self.cfg.loss.on_policy)
        return res, int(batch["loss_mask"].sum())

    def _autocast(self):
        """trainer.precision=amp_bf16: the draft's forward in bfloat16 autocast, its weights,
        gradients and optimizer state in float32."""
        if self.cfg.trainer.precision != "amp_bf16":
            return contextlib.nullcontext()
        return torch.autocast(device_type=select_device().kind, dtype=torch.bfloat16)

    def _step_weights(self, steps: int) -> list[float]:
        """The trained steps' loss weights, and 0 for the steps only validation unrolls, so
        the validation loss stays the objective training minimizes."""
        d = self.cfg.draft
        trained = list(d.step_weights) if d.step_weights else [d.step_weight_decay**j for j in range(d.ttt_steps)]
        return trained + [0.0] * (steps - d.ttt_steps)

    def _record(self, results: list[StepResult], step: int, tokens: int, split: str) -> dict:
        """Mean over micro-batches and ranks of loss, loss_k, acc_k, accept_k."""
        rows = [[r.loss.item(), *r.step_losses, *r.step_acc, *r.step_accept] for r in results]
        vals = [sum(col) / len(rows) for col in zip(*rows)]
        vals = _mean_across_ranks(vals, self.world_size)
        k = len(results[0].step_losses)
        record = {"step": step, "split": split, "loss": vals[0],
                  "tokens": _sum_across_ranks(tokens, self.world_size)}
        for name, start in (("loss", 1), ("acc", 1 + k), ("accept", 1 + 2 * k)):
            record.update({f"{name}_{j}": v for j, v in enumerate(vals[start: start + k])})
        record["accept_len"] = acceptance_length([record[f"acc_{j}"] for j in range(k) if f"acc_{j}" in record])
        return record

    def _stop_if_not_finite(self, res: StepResult, step: int, samples: list[int]) -> None:
        """After backward, before the optimizer step: a NaN/Inf loss or gradient on any
        rank stops every rank (one all-reduce; a rank's NaN would reach all through the
        gradient all-reduce), so the last checkpoint stays the last good one."""
        loss_bad = not math.isfinite(res.loss.item())
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        grad_bad = bool(grads) and not math.isfinite(torch.nn.utils.get_total_norm(grads).item())
        if _sum_across_ranks(int(loss_bad or grad_bad), self.world_size) == 0:
            return
        bad_steps = [j for j, v in enumerate(res.step_losses) if not math.isfinite(v)]
        what = ("the loss" + (f" (TTT step {bad_steps[0]}, loss {self._loss_label})" if bad_steps else "")
                if loss_bad else "a gradient" if grad_bad else "the loss or a gradient on another rank")
        latest = latest_tag(self.ckpt_root)
        where = f"; the last good checkpoint is {self.ckpt_root / latest} (latest)" if latest else \
            "; no checkpoint was written yet"
        checked = getattr(self.reader, "checked_on_read", False)
        bad_inputs = self._inputs_not_finite(samples) if (loss_bad or grad_bad) and not checked else []
        inputs = ""
        if bad_inputs:
            named = ", ".join(f"sample {self.reader.indices[i]} in {self.reader.shard_of(i)}" for i in bad_inputs)
            inputs = (f"; the cached features of {named} (cache {self.reader.cache_dir}) hold NaN/Inf "
                      "(check the cache: specft info --verify)")
        elif loss_bad or grad_bad:
            named = ", ".join(f"{self.reader.indices[i]} ({self.reader.shard_of(i)})" for i in samples)
            inputs = f"; the batch held samples {named}, whose features are finite"
        raise SpecftError(f"training stopped at step {step + 1}: {what} is not finite{where}{inputs}")

    def _inputs_not_finite(self, samples: list[int]) -> list[int]:
        """The samples of a batch whose cached features hold NaN/Inf."""
        return [i for i in samples if any(not torch.isfinite(self.reader[i][k]).all()
                                          for k in ("aux_hidden", "final_hidden"))]

    def _train_step(self, step: int) -> dict:
        results, tokens = [], 0
        for indices in self.sampler.micro_batches(step):
            samples = [self.train_idx[i] for i in indices]
            res, n = self._forward(samples, step)
            self.engine.backward(res.loss)
            self._stop_if_not_finite(res, step, samples)
            self.engine.step()
            results.append(res)
            tokens += n
        record = self._record(results, step + 1, tokens, "train")
        record["lr"] = self.engine.get_lr()[0]
        return record

    @torch.no_grad()
    def validate(self, step: int) -> dict | None:
        """Loss, acc_k, expected acceptance per step and simulated acceptance length on
        the held-out samples (each rank takes every world_size-th micro-batch)."""
        if not self.val_idx:
            return None
        micro = self.cfg.trainer.micro_batch_size
        batches = [self.val_idx[i: i + micro] for i in range(0, len(self.val_idx), micro)]
        batches = batches[: self.cfg.trainer.val_batches * self.world_size]
        mine = batches[self.rank:: self.world_size] or batches[:1]
        # A sharded head scores every rank's tokens together, and a sharded online target
        # computes them together: each rank runs as many forwards as the busiest one (the
        # surplus ones are not counted).
        together = self.head.sharded or getattr(self.val_reader, "collective", False)
        rounds = -(-len(batches) // self.world_size) if together else len(mine)
        self.engine.eval()
        results, tokens = [], 0
        replays: dict[int, list[RoundCounts]] = {k: [] for k in self.replay_k}  # per sample
        sources: list[str] = []  # each replayed sample's source
        for i in range(rounds):
            indices = mine[min(i, len(mine) - 1)]
            res, n = self._forward(indices)
            if i < len(mine):
                results.append(res)
                tokens += n
                self._replay(res, replays)
                sources += [self._val_source(j) for j in indices]
        self.engine.train()
        record = self._record(results, step, tokens, "val")
        for k, samples in replays.items():
            rows = _gather_lists([[c.rounds, c.proposed, c.accepted, source]
                                  for c, source in zip(samples, sources)], self.world_size)
            record.update(_replay_record([row[:3] for row in rows], k, self.cfg.seed))
            by_source = {row[3]: [] for row in rows}
            for row in rows:
                by_source[row[3]].append(row[:3])
            if len(by_source) > 1:  # a mix's held-out caches: each prompt set scored apart too
                for source, per_prompt in by_source.items():
                    record.update(_replay_record(per_prompt, k, self.cfg.seed, prefix=f"{source}/"))
        return record

    def _val_source(self, index: int) -> str:
        """The source of validation sample ``index`` (one name for a split of the training cache)."""
        return self.val_reader.sources[index] if isinstance(self.val_reader, SourcesReader) else "train_split"

    def _replay(self, res: StepResult, replays: dict[int, list[RoundCounts]]) -> None:
        """Greedy decoding replayed on each sample at every k (train/replay.py)."""
        hits = step_hits(res.step_hits, res.predicts.shape[1])
        for row in range(res.predicts.shape[0]):
            for k, samples in replays.items():
                samples.append(replay_sample(hits[:, row], res.predicts[row], k, self.cfg.eval.max_new_tokens))

    def train(self) -> Path:
        t = self.cfg.trainer
        start = self._resume()
        logger = None
        if self.rank == 0:
            config = OmegaConf.to_container(OmegaConf.create(self.run_config_yaml))
            logger = MetricsLogger(self.cfg.logger, self.run_dir, config, resume_step=start)
        if start >= t.max_steps:
            log.info("training already complete at step %d", start)
        t0 = time.perf_counter()
        for step in range(start, t.max_steps):
            record = self._train_step(step)
            record["elapsed_s"] = round(time.perf_counter() - t0, 3)
            last = step + 1 == t.max_steps
            if logger and ((step + 1) % t.log_every == 0 or last):
                logger.log(record)
            if self.rank == 0 and ((step + 1) % CONSOLE_EVERY == 0 or last):
                log.info("step %d loss %.4f acc_0 %.3f", record["step"], record["loss"], record.get("acc_0", 0.0))
            if last or (t.val_every and (step + 1) % t.val_every == 0):
                val = self.validate(step + 1)
                if val and logger:
                    logger.log(val)
                    log.info("val step %d loss %.4f acc_0 %.3f accept_len %.2f%s", val["step"],
                             val["loss"], val.get("acc_0", 0.0), val["accept_len"], _replay_line(val))
            if (step + 1) % t.save_every == 0 or last:
                save_checkpoint(self.engine, self.ckpt_root, step + 1, self.rank, self.world_size,
                                t.keep_last, self.extra_config, self.run_config_yaml, self._served)
        final = self.ckpt_root / "final"
        state = consolidated_state(self.engine.module)  # collective under ZeRO-3
        if self.rank == 0:
            final = save_final(self.ckpt_root, self.engine.module, self.extra_config,
                               self.run_config_yaml, self._served(state))
            logger.close()
        return final
