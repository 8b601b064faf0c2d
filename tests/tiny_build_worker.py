"""Run by tests/test_sharding.py under torch.distributed.run: every rank asks for a tiny
model that is not built yet, after the process group is up (as a sharded `specft cache`
does on a first run)."""

import sys
from pathlib import Path

import torch.distributed as dist

from specft.target_model.tiny import build_tiny

from helpers import root_cfg


def main() -> None:
    dist.init_process_group("gloo")
    out = build_tiny(root_cfg("model=tiny_qwen3").model, Path(sys.argv[1]))
    assert (out / "config.json").exists() and (out / "model.safetensors").exists(), sorted(out.iterdir())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
