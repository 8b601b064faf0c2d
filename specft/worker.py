"""One rank's work: stage 1 (cache, if needed) then stage 2 (train).

Run in-process for one rank, or by `deepspeed --no_local_rank --module specft.worker
--config RUN/config.yaml --command train` for several; the rank comes from the env."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from specft.config import RootConfig
from specft.errors import SpecftError
from specft.validate import to_schema

log = logging.getLogger(__name__)


def _init_distributed() -> tuple[int, int]:
    import torch.distributed as dist

    from specft.device import init_distributed

    init_distributed()
    return dist.get_rank(), dist.get_world_size()


def _with_quant(cfg: RootConfig, name: str) -> RootConfig:
    """The same run with another target quant config (for mixed-target training)."""
    import dataclasses

    from specft.quant.config import load_quant_config

    return dataclasses.replace(cfg, quant=load_quant_config(name, "trainer.mix_quant"))


def _with_heldout_data(cfg: RootConfig) -> RootConfig:
    """The same run on the data's validation side, answers written by the target."""
    import dataclasses

    from specft.data.select import heldout_side

    return dataclasses.replace(cfg, data=heldout_side(cfg.data, cfg.trainer.val_samples))


def run(cfg: RootConfig, command: str) -> Path | None:
    from specft.cache import ensure_cache
    from specft.launch import set_single_rank_env

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        set_single_rank_env()
    if world > 1:  # ranks sharing a host split its cores, or they thrash each other
        import torch

        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    # train always runs DeepSpeed; a sharded target needs a process group even on one rank
    needs_dist = world > 1 or command == "train" or cfg.cache.sharding in ("zero3", "tp")
    rank, world = _init_distributed() if needs_dist else (0, 1)
    try:
        cache_dir = ensure_cache(cfg, rank, world, verify=command == "cache")  # `specft cache` checks every checksum
        if command == "train":
            from specft.train.trainer import Trainer

            mix_dir = None
            if cfg.trainer.mix_quant is not None:
                mix_dir = ensure_cache(_with_quant(cfg, cfg.trainer.mix_quant), rank, world)
            val_dir = None
            if cfg.trainer.val_data == "heldout":
                log.info("validation cache: %d held-out conversations, answers by the target",
                         cfg.trainer.val_samples)
                val_dir = ensure_cache(_with_heldout_data(cfg), rank, world)
            return Trainer(cfg, cache_dir, rank, world, mix_dir, val_dir).train()
        return cache_dir
    finally:
        if needs_dist:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from specft.logs import setup_logging

    parser = argparse.ArgumentParser(prog="specft.worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--command", default="train", choices=["cache", "train"])
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    try:
        cfg = to_schema(OmegaConf.load(args.config))
        run(cfg, args.command)
    except SpecftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if rank == 0:
            print("interrupted: the same command resumes from the last checkpoint / shard", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
