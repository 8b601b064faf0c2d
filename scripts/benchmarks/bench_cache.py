"""Stage-1 cost on the real SmolLM2-135M target (MXFP4 weights, FP8 activations):
cache tokens/s against a bare forward of the same quantized target over the same batches,
bytes per token for bf16 and fp8 storage, and whether fp8 storage changes the stage-2
validation acceptance of a draft trained on it.

    python scripts/benchmarks/bench_cache.py --out docs/results/bench_cache.json

Part 1 runs in-process (the timings alternate, fastest of --repeats kept); part 2 trains
two drafts with `specft train` (bf16 vs fp8 cache, same seed and steps) in a temporary
directory. Skip part 2 with --train-steps 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specft.cache.writer import CacheWriter, _pad_batch
from specft.config import aux_layer_ids
from specft.data import DataSummary, load_conversations, tokenize_all
from specft.provenance.build import build_provenance
from specft.quant import apply_quant
from specft.target_model import FeatureCapture, load_target, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers import root_cfg  # noqa: E402  (composes conf/ exactly as the CLI does)


def batches(cfg, samples):
    """The writer's batches: shards of samples_per_shard, cut into cache.batch_size."""
    live = [i for i, s in enumerate(samples) if s is not None]
    per, bs = cfg.cache.samples_per_shard, cfg.cache.batch_size
    for shard in (live[i: i + per] for i in range(0, len(live), per)):
        for start in range(0, len(shard), bs):
            yield _pad_batch([samples[i] for i in shard[start: start + bs]], 0)


@torch.no_grad()
def time_bare(model, cfg, samples, decoder_only: bool) -> float:
    run = model.get_decoder() if decoder_only else model
    t0 = time.perf_counter()
    for ids, attn in batches(cfg, samples):
        run(input_ids=ids, attention_mask=attn, use_cache=False)
    return time.perf_counter() - t0


def time_cache(model, cfg, samples, tokenizer, dtype: str, root: Path) -> tuple[float, int]:
    cfg.cache.dtype = dtype
    out = Path(tempfile.mkdtemp(dir=root, prefix=f"cache-{dtype}-"))
    writer = CacheWriter(cfg, out, build_provenance(cfg, tokenizer))
    capture = FeatureCapture(model, aux_layer_ids(cfg.model))
    t0 = time.perf_counter()
    writer.write(capture, samples, tokenizer.pad_token_id)
    seconds = time.perf_counter() - t0
    return seconds, sum(p.stat().st_size for p in out.glob("shard-*"))


def part1(args, root: Path) -> dict:
    cfg = root_cfg("model=smollm2_135m", "quant=mxfp4", f"data.num_samples={args.samples}")
    tokenizer = load_tokenizer(cfg.model)
    samples = tokenize_all(load_conversations(cfg.data), tokenizer, cfg.data, DataSummary())
    tokens = sum(len(s.input_ids) for s in samples if s is not None)
    model, _ = load_target(cfg.model)
    apply_quant(model, cfg.quant)
    time_bare(model, cfg, samples[:8], False)  # warm-up
    best: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, fn in [("forward_with_logits", lambda: time_bare(model, cfg, samples, False)),
                         ("cache_bf16", lambda: time_cache(model, cfg, samples, tokenizer, "bf16", root)),
                         ("forward_decoder_only", lambda: time_bare(model, cfg, samples, True)),
                         ("cache_fp8", lambda: time_cache(model, cfg, samples, tokenizer, "fp8", root))]:
            result = fn()
            seconds = result[0] if isinstance(result, tuple) else result
            if isinstance(result, tuple):
                sizes[name] = result[1]
            best[name] = min(best.get(name, float("inf")), seconds)
    rows = {name: {"seconds": s, "tokens_per_s": tokens / s} for name, s in best.items()}
    for name in ("cache_bf16", "cache_fp8"):
        rows[name]["overhead_vs_forward_with_logits"] = best[name] / best["forward_with_logits"] - 1
        rows[name]["overhead_vs_forward_decoder_only"] = best[name] / best["forward_decoder_only"] - 1
        rows[name]["bytes_per_token"] = sizes[name] / tokens
    return {"samples": sum(s is not None for s in samples), "tokens": tokens, "timings": rows}


def final_val(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("split") == "val"][-1]


def part2(args, root: Path) -> dict:
    out = {}
    for dtype in ("bf16", "fp8"):
        cmd = [sys.executable, "-m", "specft.cli", "train", "model=smollm2_135m", "quant=mxfp4",
               f"cache.dtype={dtype}", f"trainer.max_steps={args.train_steps}", f"run_dir=runs/{dtype}"]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
        val = final_val(root / "runs" / dtype)
        out[dtype] = {k: v for k, v in val.items() if k.startswith(("acc", "accept", "loss"))}
        out[dtype]["wall_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--out", type=Path, default=Path("docs/results/bench_cache.json"))
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    result = {"command": " ".join(["python", *sys.argv]), "torch_threads": torch.get_num_threads(),
              "stage1": part1(args, root)}
    print(f"\nstage 1 on smollm2_135m / mxfp4: {result['stage1']['tokens']} tokens")
    print(f"{'run':24} {'seconds':>8} {'tok/s':>8} {'vs fwd+logits':>14} {'vs decoder':>11} {'B/token':>8}")
    for name, r in result["stage1"]["timings"].items():
        extra = (f"{r['overhead_vs_forward_with_logits']:+14.1%} {r['overhead_vs_forward_decoder_only']:+11.1%}"
                 f" {r['bytes_per_token']:8.0f}") if "bytes_per_token" in r else ""
        print(f"{name:24} {r['seconds']:8.1f} {r['tokens_per_s']:8.0f} {extra}")
    if args.train_steps:
        result["stage2_val"] = part2(args, root)
        print(f"\nstage-2 validation after {args.train_steps} steps (same seed):")
        for dtype, r in result["stage2_val"].items():
            print(f"  {dtype:5} " + "  ".join(f"{k}={v:.4f}" for k, v in sorted(r.items()) if k != "wall_s"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
