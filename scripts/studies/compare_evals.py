"""Two `specft eval` runs of the same drafts on the same prompts, row by row: what a code
change did to acceptance (paired 95% CI over prompts), peak KV, memory against the
target alone and decode time. Prints a markdown table and writes JSON.

    python scripts/studies/compare_evals.py --before runs/eval-old --after runs/eval-new \\
        --out docs/results/kv_compaction.json

Each run's memory and time ratios are against its own target-alone row (eval.target_alone=true),
timed in the same process, so the two runs may have shared the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specft.eval.stats import paired_difference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_decode import machine  # noqa: E402

MB = 2**20


def load(run: Path) -> dict[tuple, dict]:
    results = json.loads((run / "results.json").read_text())["results"]
    return {(r["draft"], r["k"], r["batch_size"]): r for r in results}


def row(key: tuple, before: dict, after: dict, seed: int) -> dict:
    b, a = before[key], after[key]
    out = {"draft": key[0], "k": key[1], "batch_size": key[2]}
    for name, r in (("before", b), ("after", a)):
        out[name] = {"acceptance_rate": r["acceptance_rate"], "peak_kv_mb": r["peak_kv_bytes"] / MB,
                     "memory_mb": r["memory_bytes"] / MB, "memory_vs_target_alone": r.get("memory_vs_target_alone"),
                     "decode_s": r["decode_s"],
                     "latency_change_vs_target_alone": r.get("latency_change_vs_target_alone")}
    if key[1]:  # a draft's row: acceptance on the same prompts, after - before
        out["acceptance_after_minus_before"] = paired_difference(b["per_prompt"], a["per_prompt"], seed)
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def table(rows: list[dict]) -> str:
    lines = ["| draft | k | batch | acceptance before -> after (after - before [95% CI]) | peak KV MB before -> after "
             "| memory vs target alone before -> after | time per token cut vs target alone (-: slower) before -> "
             "after |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        b, a = r["before"], r["after"]
        acc = "-"
        if "acceptance_after_minus_before" in r:
            d = r["acceptance_after_minus_before"]
            lo, hi = d["rate_difference_ci"]
            acc = (f"{b['acceptance_rate']:.3f} -> {a['acceptance_rate']:.3f} "
                   f"({100 * d['rate_difference']:+.1f} pts [{100 * lo:+.1f}, {100 * hi:+.1f}])")
        lines.append(f"| {r['draft']} | {r['k'] or '-'} | {r['batch_size']} | {acc} | "
                     f"{b['peak_kv_mb']:.1f} -> {a['peak_kv_mb']:.1f} | "
                     f"{_pct(b['memory_vs_target_alone'])} -> {_pct(a['memory_vs_target_alone'])} | "
                     f"{_pct(b['latency_change_vs_target_alone'])} -> {_pct(a['latency_change_vs_target_alone'])} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="eval.out_dir of the run before the change")
    p.add_argument("--after", type=Path, required=True, help="eval.out_dir of the run after it")
    p.add_argument("--out", type=Path, required=True, help="JSON to write")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    a = p.parse_args()
    before, after = load(a.before), load(a.after)
    keys = [k for k in before if k in after]
    if not keys:
        raise SystemExit(f"error: {a.before} and {a.after} share no (draft, k, batch) row")
    rows = [row(k, before, after, a.seed) for k in keys]
    print(table(rows))
    # The machine this runs on (the evals' own, when run where they ran) and each eval's torch threads.
    meta = {"machine": {k: v for k, v in machine().items() if k != "torch_threads"},
            "before": str(a.before), "after": str(a.after),
            "torch_threads": {side: json.loads((run / "results.json").read_text())["meta"].get("torch_threads")
                              for side, run in (("before", a.before), ("after", a.after))}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
