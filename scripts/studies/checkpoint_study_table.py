"""The tables of docs/checkpoints.md's "Does the real checkpoint matter?" from a
scripts/studies/quant_alignment.py summary.json: each draft's acceptance rate with its 95% CI
(acceptance length), then every pair of drafts as a paired difference on the same prompts.
Prints markdown and writes JSON beside the summary.

    python scripts/studies/checkpoint_study_table.py runs/gptqmodel_study/summary.json --quant gptqmodel_w4a16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specft.eval.stats import confidence, paired_difference

DRAFTS = ("baseline_16bit", "specft_emulated", "specft")
TITLES = {"baseline_16bit": "16-bit recipe", "specft_emulated": "specft on RTN emulation",
          "specft": "specft on the checkpoint"}
PAIRS = (("specft", "baseline_16bit"), ("specft", "specft_emulated"), ("specft_emulated", "baseline_16bit"))
SETS = {"gsm8k": "GSM8K", "sharegpt": "ShareGPT", "mtbench": "MT-Bench"}


def _cell(row: dict, seed: int) -> dict:
    ci = confidence(row["per_prompt"], seed)["acceptance_rate_ci"]
    return {"rate": row["acceptance_rate"], "rate_ci": ci, "length": row["acceptance_length"],
            "prompts": len(row["per_prompt"])}


def tables(rows: list[dict], quant: str, seed: int = 0) -> dict:
    found = {(r["data"], r["k"], r["draft"]): r for r in rows if r["quant"] == quant and r["k"]}
    out = {"quant": quant, "rows": [], "pairs": []}
    for data, k in sorted({(d, k) for d, k, _ in found}, key=lambda x: (list(SETS).index(x[0]), x[1])):
        present = [d for d in DRAFTS if (data, k, d) in found]
        out["rows"].append({"data": data, "k": k, **{d: _cell(found[(data, k, d)], seed) for d in present}})
        pairs = {f"{a} - {b}": paired_difference(found[(data, k, b)]["per_prompt"], found[(data, k, a)]["per_prompt"],
                                                 seed)
                 for a, b in PAIRS if a in present and b in present}
        out["pairs"].append({"data": data, "k": k, **pairs})
    return out


def markdown(result: dict) -> str:
    lines = ["| held-out set | k | " + " | ".join(TITLES.values()) + " |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        cells = [f"{c['rate']:.3f} [{c['rate_ci'][0]:.3f}, {c['rate_ci'][1]:.3f}] ({c['length']:.2f})"
                 if (c := r.get(d)) else "-" for d in DRAFTS]
        lines.append(f"| {SETS[r['data']]} | {r['k']} | " + " | ".join(cells) + " |")
    lines += ["", "| held-out set | k | " + " | ".join(
        f"{TITLES[a].replace('specft on the ', '').replace('specft on ', '')} - "
        f"{TITLES[b].replace('specft on the ', '').replace('specft on ', '')}" for a, b in PAIRS) + " |",
              "|---|---|---|---|---|"]
    for p in result["pairs"]:
        cells = []
        for a, b in PAIRS:
            d = p.get(f"{a} - {b}")
            if d is None:
                cells.append("-")
                continue
            lo, hi = (100 * x for x in d["rate_difference_ci"])
            verdict = "" if d["distinguishable"] else ": no difference"
            cells.append(f"{100 * d['rate_difference']:+.1f} [{lo:+.1f}, {hi:+.1f}]{verdict}")
        lines.append(f"| {SETS[p['data']]} | {p['k']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", type=Path)
    parser.add_argument("--quant", required=True, help="the checkpoint target's name in --targets")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    args = parser.parse_args()
    result = tables(json.loads(args.summary.read_text())["rows"], args.quant, args.seed)
    print(markdown(result))
    out = args.summary.with_name(f"tables-{args.quant}.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
