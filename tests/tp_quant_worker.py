"""Run by tests/test_sharding.py under torch.distributed.run (2 ranks): the MXFP4 target
split by transformers' tensor-parallel plan, logits on a fixed prompt saved by rank 0,
with the row-parallel activation scales reduced over the group (as specft runs) and,
for contrast, computed per shard (argv[2] == "per_shard")."""

import sys

import torch
import torch.distributed as dist

from specft.quant import apply_quant
from specft.target_model.sharding import editing, place_target

from helpers import root_cfg


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    cfg = root_cfg("model=tiny_qwen3", "quant=mxfp4", "cache.sharding=tp")
    placed = place_target(cfg, dist.get_rank(), dist.get_world_size())
    report = apply_quant(placed.model, cfg.quant, editing(placed))
    if mode == "per_shard":
        for q in report.quantizers:
            q.shard_group = None
    with torch.no_grad():
        logits = placed.model(input_ids=torch.arange(40)[None] + 7).logits
    if dist.get_rank() == 0:
        torch.save(logits, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
