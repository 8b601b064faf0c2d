"""Stage 2: train the draft head on the cache with a DeepSpeed engine."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specft.cache import CacheReader
from specft.config import RootConfig
from specft.draft import DRAFT_HEADS, Eagle3Config, build_draft_vocab
from specft.train.batches import StepSampler, collate
from specft.train.checkpoint import latest_tag, load_checkpoint, save_checkpoint, save_final
from specft.train.losses import LOSSES
from specft.train.metrics import MetricsLogger
from specft.train.objective import target_view, ttt_objective
from specft.train.schedule import warmup_cosine

log = logging.getLogger(__name__)
CONSOLE_EVERY = 10  # steps between console lines; metrics.jsonl gets every log_every


def build_draft(cfg: RootConfig, reader: CacheReader):
    target = reader.manifest["target"]
    vocab = build_draft_vocab(reader.token_counts(), cfg.draft.vocab_size)
    log.info("draft vocab: %d tokens cover %.1f%% of training tokens", vocab.size, 100 * vocab.coverage)
    qk_norm = cfg.draft.qk_norm if cfg.draft.qk_norm is not None else target["family"].startswith("qwen3")
    c = Eagle3Config(
        hidden_size=cfg.model.hidden_size, num_heads=target["num_heads"],
        num_kv_heads=target["num_kv_heads"], head_dim=target["head_dim"],
        intermediate_size=cfg.draft.intermediate_size or target["intermediate_size"],
        target_vocab_size=target["vocab_size"], draft_vocab_size=vocab.size,
        rope_theta=target["rope_theta"], rms_norm_eps=target["rms_norm_eps"], qk_norm=qk_norm)
    head = reader.target_head()
    draft = DRAFT_HEADS.get(cfg.draft.name, "draft.name")(c, head["embed_tokens"], vocab.draft_to_target)
    return draft, head["lm_head"].float()


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


def _mean_across_ranks(values: list[float], world_size: int) -> list[float]:
    if world_size == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return (t / world_size).tolist()


class Trainer:
    def __init__(self, cfg: RootConfig, cache_dir: Path, rank: int = 0, world_size: int = 1):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.reader = CacheReader(cache_dir)
        # Subnormal floats run ~100x slower on CPUs; as the draft trains, attention and
        # optimizer states produce them and steps crawl. Flushing them costs no accuracy
        # that matters for training.
        torch.set_flush_denormal(True)
        torch.manual_seed(cfg.seed)
        draft, self.lm_head = build_draft(cfg, self.reader)
        self.engine = _make_engine(cfg, draft)
        self.loss_fn = LOSSES.get(cfg.loss.name, "loss.name")
        self.sampler = StepSampler(len(self.reader), cfg.seed, cfg.trainer.micro_batch_size,
                                   cfg.trainer.grad_accum, rank, world_size)
        self.run_config_yaml = (self.run_dir / "config.yaml").read_text()
        self.extra_config = {"target_model": cfg.model.name, "quant": cfg.quant.name,
                             "aux_layer_ids": self.reader.manifest["aux_layer_ids"],
                             "target_hidden_size": cfg.model.hidden_size}

    def _resume(self) -> int:
        tag = latest_tag(self.ckpt_root) if self.cfg.trainer.resume else None
        if tag is None:
            return 0
        step = load_checkpoint(self.engine, self.ckpt_root, tag, self.rank)
        log.info("resumed from %s (step %d)", self.ckpt_root / tag, step)
        return step

    def _train_step(self, step: int) -> dict:
        draft = self.engine.module
        sums = None
        tokens = 0
        for indices in self.sampler.micro_batches(step):
            batch = collate([self.reader[i] for i in indices])
            view = target_view(batch, self.lm_head, draft.draft_to_target, draft.t2d)
            logits = self.engine(batch["input_ids"], batch["aux_hidden"], self.cfg.draft.ttt_steps)
            res = ttt_objective(logits, view, draft.draft_to_target, self.loss_fn,
                                self.cfg.draft.step_weight_decay)
            self.engine.backward(res.loss)
            self.engine.step()
            vals = [res.loss.item(), *res.step_losses, *res.step_acc]
            sums = vals if sums is None else [a + b for a, b in zip(sums, vals)]
            tokens += int(batch["loss_mask"].sum())
        n = self.cfg.trainer.grad_accum
        vals = _mean_across_ranks([v / n for v in sums], self.world_size)
        k = (len(vals) - 1) // 2
        record = {"step": step + 1, "loss": vals[0], "lr": self.engine.get_lr()[0],
                  "tokens": tokens * self.world_size}
        record.update({f"loss_{j}": v for j, v in enumerate(vals[1: 1 + k])})
        record.update({f"acc_{j}": v for j, v in enumerate(vals[1 + k:])})
        return record

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
            if (step + 1) % t.save_every == 0 or last:
                save_checkpoint(self.engine, self.ckpt_root, step + 1, self.rank, self.world_size,
                                t.keep_last, self.extra_config, self.run_config_yaml)
        final = self.ckpt_root / "final"
        if self.rank == 0:
            final = save_final(self.ckpt_root, self.engine.module, self.extra_config, self.run_config_yaml)
            logger.close()
        return final
