"""Stage-2 training throughput on a real cache: tokens/s with and without draft QAT, the
share of step time spent waiting for data, and model FLOPs utilisation (FLOPs counted
from the shapes, against a bf16 matmul's rate measured in the same run).

    python scripts/benchmarks/bench_train.py --out docs/results/bench_train.json

Builds the smollm2_135m / mxfp4 cache first if it is missing (about 2 minutes here).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specft.cache import CacheReader, ensure_cache
from specft.cli import compose
from specft.commands.validate import to_schema
from specft.common.launch import set_single_rank_env
from specft.device import native_bf16
from specft.train.batches import collate
from specft.train.trainer import Trainer


def matmul_rate(dtype: torch.dtype, n: int = 1024, reps: int = 3) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def flops_per_token(c, seq_len: int, steps: int, target_vocab: int) -> dict:
    """Forward FLOPs (2 per multiply-add) per token position, times 3 for training
    (forward + backward) for the draft; the frozen target lm_head runs forward only."""
    h, hd = c.hidden_size, c.head_dim
    qkv = 2 * h * (c.num_heads + 2 * c.num_kv_heads) * hd
    per_step = 2 * (qkv + c.num_heads * hd * h + 3 * h * c.intermediate_size + h * c.draft_vocab_size)
    attn = 2 * 2 * c.num_heads * hd * (seq_len / 2)  # scores + weighted sum, mean causal span
    fc = 2 * 3 * h * h
    draft = 3 * (fc + steps * (per_step + attn))
    target_head = 2 * h * target_vocab
    return {"draft_train": draft, "target_head": target_head, "total": draft + target_head}


class TimedTrainer(Trainer):
    """Trainer whose data fetch (cache read + collate) is timed separately."""

    data_seconds = 0.0

    def _forward(self, indices, step=None):
        t0 = time.perf_counter()
        items = [self.reader[i] for i in indices]
        batch = collate(items)
        self.data_seconds += time.perf_counter() - t0
        return self._forward_batch(batch, validating=step is None)


def compile_draft(trainer) -> str | None:
    """torch.compile the draft's forward in place (dynamic shapes: sequence lengths vary);
    the reason when it cannot be, so the variant is reported as unavailable, not run eager."""
    try:
        module = trainer.engine.module
        module.forward = torch.compile(module.forward, dynamic=True)
        return None
    except Exception as err:  # no compiler, an unsupported platform: torch raises many kinds
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"


def run_variant(base_cfg, cache_dir: Path, name: str, overrides: dict, steps: int, warmup: int) -> dict:
    overrides = dict(overrides)
    compiled = overrides.pop("compile", False)
    cfg = OmegaConf.merge(base_cfg, OmegaConf.create(overrides))
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    OmegaConf.update(cfg, "run_dir", str(run_dir))
    OmegaConf.update(cfg, "trainer.max_steps", warmup + steps)
    OmegaConf.update(cfg, "trainer.save_every", 10**9)
    root = to_schema(cfg)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    trainer = TimedTrainer(root, CacheReader(cache_dir))
    if compiled and (why := compile_draft(trainer)):
        return {"variant": name, "unavailable": why}
    t_warm = time.perf_counter()
    try:
        for s in range(warmup):
            trainer._train_step(s)
    except Exception as err:  # torch.compile fails at the first call when inductor cannot build
        if not compiled:
            raise
        return {"variant": name, "unavailable": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    warmup_s = time.perf_counter() - t_warm
    trainer.data_seconds = 0.0
    tokens = positions = 0
    t0 = time.perf_counter()
    for s in range(warmup, warmup + steps):
        rec = trainer._train_step(s)
        tokens += rec["tokens"]
        positions += sum(len(trainer.reader[i]["input_ids"]) for mb in trainer.sampler.micro_batches(s)
                         for i in (trainer.train_idx[j] for j in mb))
    wall = time.perf_counter() - t0
    c = trainer.engine.module.config
    seq = positions / (steps * root.trainer.micro_batch_size * root.trainer.grad_accum)
    flops = flops_per_token(c, int(seq), root.draft.ttt_steps, c.target_vocab_size)
    return {"variant": name, "steps": steps, "wall_s": wall, "positions_per_s": positions / wall,
            "loss_tokens_per_s": tokens / wall, "data_wait_share": trainer.data_seconds / wall,
            "draft_vocab": c.draft_vocab_size, "mean_seq_len": seq, "flops_per_position": flops, "warmup_s": warmup_s,
            "micro_batch_size": root.trainer.micro_batch_size, "precision": root.trainer.precision,
            "compiled": compiled,
            "achieved_flops_per_s": flops["total"] * positions / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cache-root", default="cache")
    p.add_argument("--data", default="synthetic", help="data config (synthetic needs no files)")
    p.add_argument("--out", type=Path, default=Path("docs/results/bench_train.json"))
    p.add_argument("--tries", action="store_true",
                   help="also the throughput tries of issue 34: micro-batches of 8 and 16 (the same steps, so "
                        "more positions each), and torch.compile of the draft's forward")
    args = p.parse_args()

    base = compose(["model=smollm2_135m", "quant=mxfp4", f"data={args.data}", f"cache.root={args.cache_root}"])
    OmegaConf.update(base, "run_dir", "unset", force_add=True)
    cache_dir = ensure_cache(to_schema(base))
    set_single_rank_env()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rates = {"bf16": matmul_rate(torch.bfloat16), "fp32": matmul_rate(torch.float32)}
    # The bf16 autocast variant only where the device computes bf16 natively: on CPUs
    # without AVX512-BF16/AMX a bf16 matmul runs ~90x slower than fp32 (the printed rates
    # show it).
    variants = {
        "fp32": {},
        "fp32 + QAT mxfp4": {"draft": {"quant": "mxfp4"}},
    }
    best = {}
    if native_bf16():
        best = {"trainer": {"precision": "amp_bf16"}}
        variants["amp_bf16"] = best
    if args.tries:
        label = "amp_bf16" if best else "fp32"
        for mb in (8, 16):
            variants[f"{label} mb{mb}"] = {"trainer": {**best.get("trainer", {}), "micro_batch_size": mb}}
        variants[f"{label} + compile"] = {**best, "compile": True}
    rows = [run_variant(base, cache_dir, n, o, args.steps, args.warmup) for n, o in variants.items()]
    for r in rows:
        if "unavailable" in r:
            print(f"{r['variant']}: unavailable ({r['unavailable']})")
    rows_run = [r for r in rows if "unavailable" not in r]
    for r in rows_run:
        r["mfu_vs_bf16_matmul"] = r["achieved_flops_per_s"] / rates["bf16"]
        r["mfu_vs_fp32_matmul"] = r["achieved_flops_per_s"] / rates["fp32"]
    print(f"\nmatmul rate 1024^3: bf16 {rates['bf16'] / 1e9:.1f} GFLOP/s, fp32 {rates['fp32'] / 1e9:.1f} GFLOP/s"
          f" ({torch.get_num_threads()} threads)")
    print(f"{'variant':20s} {'pos/s':>8s} {'loss tok/s':>10s} {'data wait':>9s} {'GFLOP/s':>8s} "
          f"{'MFU fp32':>8s} {'MFU bf16':>8s}")
    for r in rows_run:
        print(f"{r['variant']:20s} {r['positions_per_s']:8.1f} {r['loss_tokens_per_s']:10.1f} "
              f"{100 * r['data_wait_share']:8.1f}% {r['achieved_flops_per_s'] / 1e9:8.1f} "
              f"{100 * r['mfu_vs_fp32_matmul']:7.1f}% {100 * r['mfu_vs_bf16_matmul']:7.0f}%")
    out = {"matmul_flops_per_s": rates, "threads": torch.get_num_threads(), "cache": str(cache_dir),
           "native_bf16": native_bf16(), "variants": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")
    torch.distributed.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
