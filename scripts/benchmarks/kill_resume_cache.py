"""Kill -9 a stage-1 cache run at random points, resume it, and check the result equals
an uninterrupted run's, sample by sample, with no stray, corrupt or duplicate shard.

    python scripts/benchmarks/kill_resume_cache.py --trials 10 --out docs/results/kill_resume_cache.json

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

ARGS = ["cache", "model=tiny_qwen3", "quant=mxfp4", "data.num_samples=960",
        "cache.samples_per_shard=16", "cache.batch_size=1"]


def _first_shard_seen(workdir: Path) -> bool:
    return any((workdir / "cache").glob("*/shard-*")) if (workdir / "cache").exists() else False


def run(workdir: Path, kill_after: float | None) -> tuple[str, float | None]:
    """Run `specft cache`; with ``kill_after``, SIGKILL it that many seconds after its first
    shard lands (so kills fall inside the writing phase, not the start-up). Returns the
    outcome and the seconds from start to the first shard."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "specft.cli", *ARGS], cwd=workdir,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    first = None
    while proc.poll() is None and first is None:
        if _first_shard_seen(workdir):
            first = time.perf_counter() - t0
        time.sleep(0.02)
    if kill_after is None:
        return ("ok" if proc.wait() == 0 else "failed"), first
    try:
        proc.wait(timeout=kill_after)
        return "finished before the kill", first
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "killed", first


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
    outcome, first_shard = run(root / "ref", None)
    assert outcome == "ok", outcome
    full = time.perf_counter() - t0
    writing = full - first_shard  # the span in which shards are being written
    ref = cache_dir(root / "ref")
    results = []
    for trial in range(args.trials):
        work = root / f"trial-{trial}"
        work.mkdir()
        delay = rng.uniform(0.0, 0.9) * writing
        state, _ = run(work, delay)
        shards_at_kill = len(list((work / "cache").glob("*/shard-*"))) if (work / "cache").exists() else 0
        resumed, _ = run(work, None)
        problems = compare(ref, cache_dir(work)) if resumed == "ok" else [f"resume {resumed}"]
        results.append({"trial": trial, "kill_after_first_shard_s": round(delay, 2), "state": state,
                        "shards_at_kill": shards_at_kill, "problems": problems})
        print(f"trial {trial}: kill {delay:5.1f}s after the first shard ({state}, {shards_at_kill} shards written) -> "
              f"{'identical' if not problems else problems}")
    ok = sum(not r["problems"] for r in results)
    print(f"\n{ok}/{len(results)} resumed caches identical to the uninterrupted one "
          f"({sum(r['state'] == 'killed' for r in results)} runs actually killed mid-way)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(["specft", *ARGS]), "uninterrupted_s": full,
                                     "first_shard_s": first_shard, "trials": results}, indent=2))
    sys.exit(0 if ok == len(results) else 1)


if __name__ == "__main__":
    main()
