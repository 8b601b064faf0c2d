"""Kill -9 a stage-1 cache run at random points, resume it, and check the result equals
an uninterrupted run's, sample by sample, with no stray, corrupt or duplicate shard.

    python scripts/kill_resume_cache.py --trials 10 --out docs/results/kill_resume_cache.json

Runs `specft cache` on tiny_qwen3 in a temporary directory (tiny models are built under
$SPECFT_HOME, a temporary one unless set).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specft.cache import CacheReader

ARGS = ["cache", "model=tiny_qwen3", "quant=mxfp4", "data.num_samples=480",
        "cache.samples_per_shard=16", "cache.batch_size=1"]


def run(workdir: Path, kill_after: float | None) -> str:
    proc = subprocess.Popen([sys.executable, "-m", "specft.cli", *ARGS], cwd=workdir,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    if kill_after is None:
        return "ok" if proc.wait() == 0 else "failed"
    try:
        proc.wait(timeout=kill_after)
        return "finished before the kill"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "killed"


def cache_dir(workdir: Path) -> Path:
    (d,) = [p for p in (workdir / "cache").iterdir() if p.is_dir()]
    return d


def compare(ref: Path, got: Path) -> list[str]:
    problems = []
    manifest = json.loads((got / "manifest.json").read_text())
    listed = [s["file"] for s in manifest["shards"]]
    on_disk = sorted(p.name for p in got.iterdir() if "shard" in p.name)
    if sorted(listed) != on_disk:
        problems.append(f"shards on disk {on_disk} != manifest {sorted(listed)}")
    indices = [i for s in manifest["shards"] for i in s["sample_index"]]
    if len(indices) != len(set(indices)):
        problems.append("a sample is in two shards")
    a, b = CacheReader(ref), CacheReader(got)
    if len(a) != len(b):
        problems.append(f"{len(b)} samples, expected {len(a)}")
    for i in range(min(len(a), len(b))):
        x, y = a[i], b[i]
        if any(not torch.equal(x[k], y[k]) for k in x):
            problems.append(f"sample {i} differs")
    return problems


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/results/kill_resume_cache.json"))
    args = p.parse_args()
    os.environ.setdefault("SPECFT_HOME", tempfile.mkdtemp(prefix="specft-home-"))
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="kill-resume-"))
    (root / "ref").mkdir()
    t0 = time.perf_counter()
    assert run(root / "ref", None) == "ok"
    full = time.perf_counter() - t0
    ref = cache_dir(root / "ref")
    results = []
    for trial in range(args.trials):
        work = root / f"trial-{trial}"
        work.mkdir()
        delay = rng.uniform(0.3, 0.95) * full  # start-up is most of a tiny run: kill late
        state = run(work, delay)
        shards_at_kill = len(list((work / "cache").glob("*/shard-*"))) if (work / "cache").exists() else 0
        resumed = run(work, None)
        problems = compare(ref, cache_dir(work)) if resumed == "ok" else [f"resume {resumed}"]
        results.append({"trial": trial, "kill_after_s": round(delay, 2), "state": state,
                        "shards_at_kill": shards_at_kill, "problems": problems})
        print(f"trial {trial}: kill at {delay:5.1f}s ({state}, {shards_at_kill} shards written) -> "
              f"{'identical' if not problems else problems}")
    ok = sum(not r["problems"] for r in results)
    print(f"\n{ok}/{len(results)} resumed caches identical to the uninterrupted one "
          f"({sum(r['state'] == 'killed' for r in results)} runs actually killed mid-way)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"uninterrupted_s": full, "trials": results}, indent=2))
    sys.exit(0 if ok == len(results) else 1)


if __name__ == "__main__":
    main()
