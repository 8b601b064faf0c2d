"""Where a speculative round's time goes in llama.cpp, and the acceptance a draft needs to beat
the target alone (docs/serving.md).

A round with k drafted tokens costs R(k) = V(k+1) + k*D: one verify pass of the target over
k+1 rows, and k draft steps (with the draft's share of each verify: its encoder and its
KV writes). It emits 1 + (accepted tokens) tokens, where the target alone emits one per
V(1). So speculation beats the target alone when the acceptance rate a (accepted / drafted,
llama.cpp's counter) exceeds

    a* = (R(k) / V(1) - 1) / k.

- V(N): the CPU time of one decode of N = 1..6 rows (llama-bench, one thread, at an empty
  context: the attention over a few hundred tokens is small beside the products), from
  the difference between runs of 2 and 2 + --repetitions repetitions (model load and
  warm-up cancel), three such samples (mean and spread).
- D: from a bench_llamacpp.json (--bench, one server thread, CPU seconds counted), per draft
  row at one slot: the server's CPU time on the same prompts, less the target alone's
  prompt processing (its CPU time less V(1) per token it generated), less V(k+1) per round,
  over k drafted tokens per round. It holds all the draft's work (its steps, its encoder
  and KV writes on every verify and on the prompt) and the server's per-round bookkeeping.
  Rows without CPU time or without a target-alone row are skipped. llama-bench computes one
  row of logits per decode where a verify pass computes k+1, so D here also holds the
  verify's other k rows of the output head (on SmolLM2 ~0.22 V(1) each) and is an upper
  bound: profile_llamacpp.py splits a round inside the server by kernel (docs/serving.md).

Prints the tables and writes round_cost.json.

    python scripts/benchmarks/round_cost.py --targets mxfp4=smollm2-MXFP4.gguf q4_k_m=... \
        --bench runs/bench/bench_llamacpp.json --out runs/round_cost
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def _cpu_seconds_of(args: list[str]) -> float:
    """The CPU time (user + system) a child command spends, whatever else runs on the machine."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(args, capture_output=True, text=True, timeout=3600)  # a hang bound
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"llama-bench failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def verify_costs(gguf: Path, rows: list[int], repetitions: int, threads: int, samples: int = 3) -> dict[int, dict]:
    """N -> {mean_ms, sd_ms, samples_ms}: the CPU time of one decode of N rows, from llama-bench
    (-p N -n 0, one thread) run with 2 and with 2 + ``repetitions`` repetitions: the
    difference over ``repetitions`` leaves out the model load and warm-up. CPU time, not
    llama-bench's wall clock, so other jobs on the machine do not inflate it."""
    from statistics import mean, stdev

    from specft.llamacpp.install import binary

    base = [str(binary("llama-bench")), "-m", str(gguf), "-n", "0", "-t", str(threads), "-o", "json"]
    out = {}
    for n in rows:
        per_decode = []
        for _ in range(samples):
            few = _cpu_seconds_of([*base, "-p", str(n), "-r", "2"])
            many = _cpu_seconds_of([*base, "-p", str(n), "-r", str(2 + repetitions)])
            per_decode.append(1e3 * (many - few) / repetitions)
        out[n] = {"mean_ms": mean(per_decode), "sd_ms": stdev(per_decode) if len(per_decode) > 1 else 0.0,
                  "samples_ms": per_decode}
    return out


def draft_costs(bench: dict, costs: dict[str, dict[int, dict]]) -> list[dict]:
    """Per draft row of a bench_llamacpp.json at one slot: D/V(1), R(k)/V(1), the break-even
    acceptance a* and the acceptance the draft reached."""
    out = []
    alone = {r["target"]: r for r in bench["rows"] if r["draft"] == "alone" and r["slots"] == 1}
    model_drafts = {name for name, spec in bench["drafts"].items() if not str(spec).startswith("ngram:")}
    for row in bench["rows"]:
        if row["draft"] not in model_drafts or row["slots"] != 1 or row["target"] not in costs \
                or row["target"] not in alone:
            continue
        v, k = costs[row["target"]], row["k"]
        cpu = [r.get("cpu_seconds") for r in row["runs"]]
        cpu_alone = [r.get("cpu_seconds") for r in alone[row["target"]]["runs"]]
        if k + 1 not in v or not all(cpu) or not all(cpu_alone):
            continue
        v1 = v[1]["mean_ms"]
        runs = len(cpu)
        # the prompts' processing, as the target alone paid it (per repeat)
        prompt_ms = 1e3 * sum(cpu_alone) / len(cpu_alone) - v1 * alone[row["target"]]["runs"][0]["tokens"]
        rounds = row["drafted"] / k
        rounds_ms = 1e3 * sum(cpu) - runs * prompt_ms
        d_ms = (rounds_ms / rounds - v[k + 1]["mean_ms"]) / k
        r_over_v1 = (v[k + 1]["mean_ms"] + k * d_ms) / v1
        out.append({"target": row["target"], "draft": row["draft"], "k": k, "d_over_v1": d_ms / v1,
                    "round_over_v1": r_over_v1, "verify_over_v1": v[k + 1]["mean_ms"] / v1,
                    "breakeven_acceptance": (r_over_v1 - 1) / k, "acceptance": row["acceptance"],
                    "acceptance_ci": row.get("acceptance_ci")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", nargs="+", required=True, help="NAME=FILE.gguf (names as in --bench)")
    ap.add_argument("--bench", type=Path, help="a bench_llamacpp.json with CPU seconds (one server thread)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--repetitions", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("runs/round_cost"))
    args = ap.parse_args()
    targets = dict(t.split("=", 1) for t in args.targets)
    costs = {name: verify_costs(Path(path), args.rows, args.repetitions, args.threads)
             for name, path in targets.items()}
    lines = ["| target | " + " | ".join(f"V({n})/V(1)" for n in args.rows) + " | V(1) ms |",
             "|---|" + "---|" * (len(args.rows) + 1)]
    for name, v in costs.items():
        v1 = v[1]["mean_ms"]
        lines.append(f"| {name} | " + " | ".join(f"{v[n]['mean_ms'] / v1:.2f}" for n in args.rows)
                     + f" | {v1:.2f} ± {v[1]['sd_ms']:.2f} |")
    drafts = draft_costs(json.loads(args.bench.read_text()), costs) if args.bench else []
    if drafts:
        lines += ["", "| target | draft | k | D/V(1) | R(k)/V(1) | break-even acceptance | acceptance [95% CI] |",
                  "|---|---|---|---|---|---|---|"]
        for d in drafts:
            ci = d["acceptance_ci"] or [float("nan")] * 2
            lines.append(f"| {d['target']} | {d['draft']} | {d['k']} | {d['d_over_v1']:.3f} | {d['round_over_v1']:.2f} "
                         f"| {d['breakeven_acceptance']:.3f} | {d['acceptance']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] |")
    from specft.llamacpp.install import install_record

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_llamacpp import machine

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "round_cost.json").write_text(json.dumps(
        {"machine": machine(), "llamacpp": install_record(), "threads": args.threads,
         "repetitions": args.repetitions, "targets": targets, "verify_ms": costs, "drafts": drafts}, indent=1))
    print("\n".join(lines))
    print(f"wrote {args.out / 'round_cost.json'}")


if __name__ == "__main__":
    main()
