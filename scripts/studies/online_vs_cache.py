"""Online training against training from a cache, on the real SmolLM2-135M target (MXFP4):
the same data, steps and seed; per variant, the wall time of the whole command (the cache
variant builds its cache first), stage 2's answer (loss) tokens per second, the peak
memory of the process tree, the bytes written to disk and the final validation loss.

    python scripts/studies/online_vs_cache.py --out-dir runs/online_vs_cache

The variants run one after the other in one run, so their ratios compare like with like
on this machine; a variant whose run dir holds a finished draft is not rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from steps import SHARED

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_decode import machine  # noqa: E402

VARIANTS = ("cache", "online")


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def run_measured(cmd: list[str], log: Path) -> tuple[float, int]:
    """(wall seconds, peak resident bytes of the command's process tree, sampled 5x/s)."""
    peak, t0 = 0, time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        watched = psutil.Process(proc.pid)
        done = threading.Event()

        def sample():
            nonlocal peak
            while not done.wait(0.2):
                peak = max(peak, tree_rss(watched))

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        code = proc.wait()
        done.set()
        thread.join()
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {code}; see {log}")
    return time.perf_counter() - t0, peak


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def train_rates(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    seconds = train[-1]["elapsed_s"]
    return {"steps": len(train), "train_s": seconds, "answer_tokens_per_s": sum(r["tokens"] for r in train) / seconds,
            "val_loss": val[-1]["loss"] if val else None, "losses": [r["loss"] for r in train]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("runs/online_vs_cache"))
    p.add_argument("--samples", type=int, default=256, help="GSM8K training samples (their reference answers)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--quant", default="mxfp4")
    p.add_argument("--gsm8k", type=Path, default=SHARED / "gsm8k" / "train.jsonl")
    a = p.parse_args()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    common = ["train", "model=smollm2_135m", f"quant={a.quant}", "data=gsm8k", f"data.path={a.gsm8k}",
              f"data.num_samples={a.samples}", "data.max_seq_len=512", "draft.vocab_size=4096",
              f"trainer.max_steps={a.steps}", f"trainer.save_every={a.steps}", "seed=0"]
    rows = []
    for variant in VARIANTS:
        run_dir, cache_root = a.out_dir / f"{variant}-run", a.out_dir / f"{variant}-cache"
        record_path = a.out_dir / f"{variant}.json"
        if record_path.exists() and (run_dir / "checkpoints" / "final").exists():
            rows.append(json.loads(record_path.read_text()))
            continue
        cmd = [sys.executable, "-m", "specft.cli", *common, f"trainer.features={variant}",
               f"run_dir={run_dir}", f"cache.root={cache_root}"]
        wall, peak = run_measured(cmd, a.out_dir / f"{variant}.log")
        row = {"variant": variant, "wall_s": wall, "peak_rss_mb": peak / 2**20,
               "disk_written_mb": (disk_bytes(cache_root) + disk_bytes(run_dir)) / 2**20,
               "cache_mb": disk_bytes(cache_root) / 2**20, **train_rates(run_dir)}
        record_path.write_text(json.dumps(row, indent=2))
        rows.append(row)
    summary = {"machine": machine(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
               "args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}
    (a.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{'variant':>8} {'wall s':>8} {'train s':>8} {'ans tok/s':>10} {'peak MB':>8} {'disk MB':>8} "
          f"{'cache MB':>9} {'val loss':>9}")
    for r in rows:
        print(f"{r['variant']:>8} {r['wall_s']:8.1f} {r['train_s']:8.1f} {r['answer_tokens_per_s']:10.1f} "
              f"{r['peak_rss_mb']:8.0f} {r['disk_written_mb']:8.1f} {r['cache_mb']:9.1f} "
              f"{r['val_loss'] if r['val_loss'] is not None else float('nan'):9.4f}")


if __name__ == "__main__":
    main()
