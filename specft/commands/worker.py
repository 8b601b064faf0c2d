"""One rank: its environment, threads and process group, then the job (pipeline.py).

Run in-process for one rank, or by `deepspeed --no_local_rank --module specft.commands.worker
--config RUN/config.yaml --command train` for several; the rank comes from the env."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from specft.commands.validate import to_schema
from specft.common.disk import is_disk_full, job_disk_full_line
from specft.common.errors import SpecftError
from specft.config import RootConfig

log = logging.getLogger(__name__)


def _init_distributed(rendezvous_timeout_s: float) -> tuple[int, int]:
    import torch.distributed as dist

    from specft.common.rendezvous import meet
    from specft.device import init_distributed

    # several ranks meet at node 0 within the bounded timeout; one rank serves itself
    init_distributed(meet(rendezvous_timeout_s) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    return dist.get_rank(), dist.get_world_size()


def run(cfg: RootConfig, command: str) -> Path | None:
    from specft.commands.pipeline import run_job
    from specft.common.launch import set_single_rank_env

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        set_single_rank_env()
    if world > 1:  # ranks sharing a host split its cores, or they thrash each other
        import torch

        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    # train always runs DeepSpeed; a sharded target needs a process group even on one rank
    needs_dist = world > 1 or command == "train" or cfg.cache.sharding in ("zero3", "tp")
    rank, world = _init_distributed(cfg.trainer.rendezvous_timeout_s) if needs_dist else (0, 1)
    try:
        return run_job(cfg, command, rank, world)
    finally:
        if needs_dist:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from specft.common.logs import setup_logging

    parser = argparse.ArgumentParser(prog="specft.commands.worker")
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
    except Exception as err:
        if not is_disk_full(err):
            raise
        print(f"error: {job_disk_full_line(args.config)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
