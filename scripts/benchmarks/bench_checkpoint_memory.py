"""Peak memory of a quantized checkpoint target, packed against dense
(model.checkpoint_weights) on one rank, and dense in ZeRO-3 partitions over two ranks
(cache.sharding=zero3), with the forward's speed, side by side on one machine.

Each (checkpoint, mode) runs in fresh processes, one after the other: it loads the target
as stage 1 does (model=hf model.path=DIR quant=checkpoint), then runs --forwards forward
passes over a batch of --tokens random tokens. It reports the peak RSS per rank after the
load and after the forwards (ru_maxrss, so the load's transient peak counts; the larger
rank's under zero3), the bytes the rank's tensors hold, the load time and the forward's
median time; the last forward's logits are compared with the dense ones (they must be
equal, bit for bit). Every process runs one torch thread (the two zero3 ranks share the
two cores of the machine this was written on), so the logits can be equal and the
forward times compare.

    python scripts/benchmarks/bench_checkpoint_memory.py /work/ckpts/smollm2_gptq_g64_actorder \\
        --out docs/results/checkpoints/memory
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specft.common.launch import free_port

MODES = ("dense", "packed", "zero3")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _zero3_model(model_dir: Path, dtype: str):
    """(model, bytes this rank holds): the target placed as stage 1 places it under
    cache.sharding=zero3, on this rank of the torch.distributed.run group."""
    import deepspeed
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from specft.cli import compose
    from specft.commands.validate import to_schema
    from specft.quant import apply_quant
    from specft.target_model.sharding import editing, place_target

    deepspeed.init_distributed("gloo")
    cfg = compose(["model=hf", f"model.path={model_dir}", "quant=checkpoint", f"model.dtype={dtype}",
                   "cache.sharding=zero3", "trainer.nproc=2"])
    OmegaConf.update(cfg, "run_dir", "unset", force_add=True)
    root = to_schema(cfg)
    placed = place_target(root, dist.get_rank(), dist.get_world_size())
    apply_quant(placed.model, root.quant, editing(placed))
    held = placed.local_weight_bytes() + sum(b.numel() * b.element_size() for b in placed.model.buffers())
    return placed.model.eval(), held


def _ranks_peak_mb(value: float) -> float:
    """The largest rank's figure (this process's when not distributed)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return max(every)


def measure(model_dir: Path, mode: str, tokens: int, forwards: int, dtype: str, logits_out: Path) -> dict:
    """One process's figures (run with --child; under zero3 every rank runs it, rank 0
    reports)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checks"))
    from check_checkpoints import specft_model

    ids = torch.randint(0, 2**31 - 1, (1, tokens), generator=torch.Generator().manual_seed(0))
    base_mb = _peak_mb()
    t0 = time.perf_counter()
    if mode == "zero3":
        model, held = _zero3_model(model_dir, dtype)
    else:
        model, _ = specft_model(model_dir, "checkpoint", f"model.dtype={dtype}", f"model.checkpoint_weights={mode}",
                                "eval.dtype=float32")
        held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    load_s = time.perf_counter() - t0
    load_mb = _ranks_peak_mb(_peak_mb())
    ids = ids % model.config.vocab_size  # drawn before the load: a dense load's init draws from torch's RNG
    times = []
    with torch.no_grad():
        for _ in range(forwards):
            t0 = time.perf_counter()
            logits = model(ids).logits
            times.append(time.perf_counter() - t0)
    torch.save(logits, logits_out)
    return {"checkpoint": model_dir.name, "mode": mode, "dtype": dtype, "tensors_mb": held / 2**20,
            "threads": torch.get_num_threads(), "peak_rss_mb_before_load": _ranks_peak_mb(base_mb),
            "peak_rss_mb_after_load": load_mb, "peak_rss_mb": _ranks_peak_mb(_peak_mb()),
            "load_s": load_s, "forward_s_median": statistics.median(times), "forwards": forwards, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", type=Path)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--forwards", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "LOGITS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, logits = args.child
        row = measure(args.checkpoints[0], mode, args.tokens, args.forwards, args.dtype, Path(logits))
        if int(os.environ.get("RANK", "0")) == 0:
            print("ROW " + json.dumps(row))
        return
    rows, scratch = [], Path(args.out or ".") / ".logits"
    scratch.mkdir(parents=True, exist_ok=True)
    for ckpt in args.checkpoints:
        for mode in MODES:
            launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                      "--master_port", str(free_port())] if mode == "zero3" else [sys.executable]
            cmd = [*launch, __file__, str(ckpt), "--tokens", str(args.tokens), "--forwards", str(args.forwards),
                   "--dtype", args.dtype, "--child", mode, str(scratch / f"{ckpt.name}-{mode}.pt")]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
            rows.append(json.loads(next(line[4:] for line in out.splitlines() if line.startswith("ROW "))))
            logits = {m: torch.load(scratch / f"{ckpt.name}-{m}.pt") for m in ("dense", mode)}
            rows[-1]["logits_equal_to_dense"] = bool(torch.equal(logits["dense"], logits[mode]))
    lines = ["| checkpoint | mode | ranks x threads | tensors MB per rank | peak RSS after load MB per rank "
             "| peak RSS MB per rank | load s | forward s (median) | logits = dense |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ranks = 2 if r["mode"] == "zero3" else 1
        lines.append(f"| {r['checkpoint']} | {r['mode']} | {ranks} x {r['threads']} | {r['tensors_mb']:.0f} | "
                     f"{r['peak_rss_mb_after_load']:.0f} | {r['peak_rss_mb']:.0f} | {r['load_s']:.1f} | "
                     f"{r['forward_s_median']:.3f} | {r['logits_equal_to_dense']} |")
    machine = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
               "threads_per_process": 1, "dtype": args.dtype, "tokens": args.tokens}
    table = "\n".join(lines)
    print(table)
    print(machine)
    if args.out:
        (args.out / "memory.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
        (args.out / "memory.md").write_text(f"{table}\n\n{machine}\n")
    for f in scratch.iterdir():
        f.unlink()
    scratch.rmdir()


if __name__ == "__main__":
    main()
