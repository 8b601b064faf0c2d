"""Stage 2 with the frozen target head whole on every rank or split over the ranks
(trainer.target_head, issue 9): per-rank peak RSS, head rows per rank, seconds per step.

    python scripts/benchmarks/bench_target_head.py --out docs/results/target_head.json -- \
        model=smollm2_135m quant=mxfp4 cache.dir=CACHE ...   # the overrides of an existing cache

Each placement runs `specft train` with trainer.nproc ranks from scratch in its own run
directory, on the same cache; RSS is polled from the rank processes every 0.2 s.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def run(placement: str, overrides: list[str], nproc: int, steps: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "specft.cli", "train", *overrides, f"trainer.nproc={nproc}",
           f"trainer.max_steps={steps}", f"trainer.save_every={steps}", f"trainer.target_head={placement}",
           f"run_dir={run_dir}", "trainer.val_fraction=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak: dict[int, int] = {}
    while proc.poll() is None:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                line = " ".join(child.cmdline())
                if "-m specft.commands.worker" in line:  # a rank, not DeepSpeed's per-node launcher
                    peak[child.pid] = max(peak.get(child.pid, 0), child.memory_info().rss)
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.2)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{placement}: specft train failed:\n{err[-3000:]}")
    rows = re.search(r"target head: \w+, (\d+) of (\d+) rows per rank \(([\d.]+) MB\)", err)
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if m.get("split") == "train"]
    # The first step carries start-up work; time the rest.
    per_step = (train[-1]["elapsed_s"] - train[0]["elapsed_s"]) / max(1, len(train) - 1)
    return {"placement": placement, "ranks": nproc, "head_rows_per_rank": int(rows[1]),
            "vocab": int(rows[2]), "head_mb_per_rank": float(rows[3]),
            "peak_rss_mb_per_rank": sorted(round(v / 2**20) for v in peak.values()),
            "s_per_step": round(per_step, 3), "final_loss": train[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("overrides", nargs="*", help="specft overrides naming an existing cache")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for placement in ("replicated", "sharded"):
            results.append(run(placement, args.overrides, args.nproc, args.steps, Path(tmp) / placement))
    print(f"{'head':<11} {'ranks':>5} {'rows/rank':>10} {'head MB/rank':>12} {'peak RSS MB/rank':>17} "
          f"{'s/step':>7} {'final loss':>10}")
    for r in results:
        rss = "/".join(map(str, r["peak_rss_mb_per_rank"]))
        print(f"{r['placement']:<11} {r['ranks']:>5} {r['head_rows_per_rank']:>10} {r['head_mb_per_rank']:>12.1f} "
              f"{rss:>17} {r['s_per_step']:>7.3f} {r['final_loss']:>10.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
