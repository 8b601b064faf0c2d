"""Per-rank memory of a sharded target (issue 9): weights each rank holds and its peak RSS,
one rank unsharded against two ranks under ZeRO-3 and tensor parallelism.

    python scripts/benchmarks/bench_sharding.py --out docs/results/sharding_memory.json

Each setting runs `python -m torch.distributed.run` over this file in --worker mode: the
target is placed as `specft cache` places it (cache.sharding), quantized (quant config),
and runs one forward on a 64-token prompt, so gathered layers count in the peak.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = [  # (model, sharding, ranks, quant). Quantization is fake (values, not storage),
    # so bytes do not depend on it; TP splits MoE experts, for which specft quantizes weights only.
    ("smollm2_135m", "none", 1, "mxfp4"), ("smollm2_135m", "zero3", 2, "mxfp4"),
    ("tiny_qwen3_moe", "none", 1, "mxfp4"), ("tiny_qwen3_moe", "zero3", 2, "mxfp4"),
    ("tiny_qwen3_moe", "tp", 2, "w4a16"),
]


def resharded_copy(model: str, shard_mb: int, tmp: Path) -> Path:
    """The model's checkpoint saved again in files of at most shard_mb: a real 235B
    checkpoint comes in ~5 GB files, and ZeRO-3 loading holds one file at a time, so
    the test checkpoint must be in several files too for the peak to show it."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specft.cli import compose
    from specft.commands.validate import to_schema
    from specft.target_model.loader import MODEL_SOURCES

    cfg = compose([f"model={model}"])
    OmegaConf.update(cfg, "run_dir", "unset", force_add=True)
    where, _ = MODEL_SOURCES.get(cfg.model.source)(to_schema(cfg).model)
    out = tmp / f"{model}-{shard_mb}mb"
    AutoModelForCausalLM.from_pretrained(where).save_pretrained(out, max_shard_size=f"{shard_mb}MB")
    AutoTokenizer.from_pretrained(where).save_pretrained(out)
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from specft.cli import compose
    from specft.commands.validate import to_schema
    from specft.common.launch import set_single_rank_env
    from specft.quant import apply_quant
    from specft.target_model.sharding import editing, place_target

    set_single_rank_env()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = compose([f"model={args.model}", f"quant={args.quant}", f"cache.sharding={args.sharding}",
                   "model.source=hf", f"model.path={args.path}"])
    OmegaConf.update(cfg, "run_dir", "unset", force_add=True)
    root = to_schema(cfg)
    placed = place_target(root, rank, world)
    apply_quant(placed.model, root.quant, editing(placed))
    with torch.no_grad():
        placed.model(input_ids=torch.arange(64)[None] + 5)
    record = {"model": args.model, "sharding": args.sharding, "quant": args.quant, "ranks": world, "rank": rank,
              "weight_bytes": placed.local_weight_bytes(),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    Path(args.out).with_suffix(f".r{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def run_setting(model: str, path: Path, sharding: str, ranks: int, quant: str, tmp: Path) -> list[dict]:
    from specft.common.launch import free_port

    out = tmp / f"{model}-{sharding}-{ranks}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
           "--master_port", str(free_port()), __file__, "--worker", "--model", model,
           "--sharding", sharding, "--quant", quant, "--path", str(path), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{model} {sharding} x{ranks} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(out.with_suffix(f".r{r}.json").read_text()) for r in range(ranks)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/results/sharding_memory.json"))
    p.add_argument("--quant", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shard-mb", type=int, default=64, help="checkpoint file size for the test copies")
    p.add_argument("--model"), p.add_argument("--sharding"), p.add_argument("--path")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {m: resharded_copy(m, args.shard_mb, Path(tmp)) for m in dict.fromkeys(s[0] for s in SETTINGS)}
        for model, sharding, ranks, quant in SETTINGS:
            rows += run_setting(model, paths[model], sharding, ranks, quant, Path(tmp))
    base = {r["model"]: r for r in rows if r["ranks"] == 1}
    print("| model | sharding | quant | ranks | rank | weights MB | vs 1 rank | peak RSS MB | vs 1 rank "
          f"|\n|{'---|' * 9}")
    for r in rows:
        b = base[r["model"]]
        r["weights_vs_one_rank"] = r["weight_bytes"] / b["weight_bytes"]
        r["rss_vs_one_rank"] = r["peak_rss_bytes"] / b["peak_rss_bytes"]
        print(f"| {r['model']} | {r['sharding']} | {r['quant']} | {r['ranks']} | {r['rank']} | "
              f"{r['weight_bytes'] / 1e6:.1f} | "
              f"{r['weights_vs_one_rank']:.2f} | {r['peak_rss_bytes'] / 1e6:.0f} | {r['rss_vs_one_rank']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"checkpoint_file_mb": args.shard_mb, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
