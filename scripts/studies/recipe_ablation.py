"""Issue 15, part 4: recipe ablations at a fixed budget, scored by the trainer's replayed
validation (the held-out prompts' greedy decoding, which lands on `specft eval`'s count;
docs/results.md), with 95% CIs and paired differences against the reference recipe.

    python scripts/studies/recipe_ablation.py --out-dir runs/vocab_sweep    # reuses that sweep's caches
    # GSM8K + ShareGPT (quant_alignment.py's data): validation scores each held-out set
    python scripts/studies/recipe_ablation.py --mix --sharegpt-samples 160 --ttt-steps 3 --variants reference,ttt_5

Every variant trains on the same cache and validates on the same held-out samples; only
its overrides differ. Steps resume; summary-ablation.md / .json are rewritten at the end
from every finished variant (so two processes may split --variants; start the second once
the first has built the held-out caches).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vocab_sweep import Sweep, add_arguments

from specft.eval.stats import confidence, paired_difference

VARIANTS = {
    "reference": (),
    # The reference recipe again with another seed (init, data order, prior sampling): the
    # spread between seeds that a CI over prompts does not include.
    "seed_1": ("seed=1",),
    "seed_2": ("seed=2",),
    "ttt_3": ("draft.ttt_steps=3",),
    "ttt_5": ("draft.ttt_steps=5",),
    "ttt_7": ("draft.ttt_steps=7",),
    "loss_lk": ("loss=lk",),
    "lr_3e-3": ("trainer.lr=3e-3",),
    "lr_3e-4": ("trainer.lr=3e-4",),
    "steps_x2": ("trainer.max_steps={steps2}",),
    "steps_x4": ("trainer.max_steps={steps4}",),
    "noise_0.05": ("trainer.feature_noise=0.05",),
    "init_target_layer": ("draft.init=target_layer",),
}


def overrides(name: str, steps: int) -> tuple[str, ...]:
    return tuple(o.format(steps2=2 * steps, steps4=4 * steps) for o in VARIANTS[name])


def last_val(run: Path) -> dict:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [m for m in metrics if m["split"] == "val"][-1]


def score(val: dict, prefix: str, k: int, ref: dict | None, seed: int) -> dict:
    """One prompt set's replayed acceptance with its CI, and the paired difference
    against the reference's on the same prompts."""
    per = val[f"{prefix}replay_per_prompt_k{k}"]
    row = {"rate": val[f"{prefix}replay_accept_rate_k{k}"], "rate_ci": confidence(per, seed)["acceptance_rate_ci"],
           "length": val[f"{prefix}replay_accept_len_k{k}"]}
    if ref is not None:
        row["vs_reference"] = paired_difference(ref[f"{prefix}replay_per_prompt_k{k}"], per, seed)
    return row


def prompt_sets(val: dict, k: int) -> dict[str, str]:
    """Label -> key prefix: each source validation scored apart, then all together."""
    sources = [key.split("/")[0] for key in val if key.endswith(f"/replay_per_prompt_k{k}")]
    return {**{source: f"{source}/" for source in sources}, "all": ""}


def cell(r: dict) -> str:
    text = f"{r['rate']:.3f} [{r['rate_ci'][0]:.3f}, {r['rate_ci'][1]:.3f}] ({r['length']:.2f})"
    d = r.get("vs_reference")
    if d is None:
        return text
    lo, hi = d["rate_difference_ci"]
    return (text + f"; {100 * d['rate_difference']:+.1f} pts [{100 * lo:+.1f}, {100 * hi:+.1f}]"
            + ("" if d["distinguishable"] else ", no difference"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--vocab", default="seen", help="the draft vocabulary every variant uses (a --sizes value)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="the variants this process trains")
    args = p.parse_args()
    sweep = Sweep(args, "walls-ablation.json")
    for name in [v for v in args.variants.split(",") if v]:
        sweep.train(args.vocab, sweep.out / f"ablation-{name}", overrides(name, args.steps))
    # Every finished variant, whichever process trained it.
    vals = {name: last_val(sweep.out / f"ablation-{name}") for name in VARIANTS
            if (sweep.out / f"ablation-{name}" / "checkpoints" / "final").exists()}
    k = int(args.k)
    ref = vals.get("reference")
    sets = prompt_sets(next(iter(vals.values())), k)
    table = [{"variant": name, "overrides": list(overrides(name, args.steps)),
              **{label: score(val, prefix, k, ref if name != "reference" else None, args.seed)
                 for label, prefix in sets.items()}} for name, val in vals.items()]
    (sweep.out / "summary-ablation.json").write_text(json.dumps(
        {"k": k, "prompt_sets": list(sets), "rows": table, "wall_s": sweep.steps.walls}, indent=2))
    lines = [f"| variant | overrides | {' | '.join(sets)} |", "|---|---|" + "---|" * len(sets),
             *(f"| {r['variant']} | {' '.join(r['overrides'])} | {' | '.join(cell(r[s]) for s in sets)} |"
               for r in table)]
    note = (f"Replayed acceptance at k={k} [95% CI] (acceptance length); for a variant, then its paired "
            "difference from the reference [95% CI].")
    (sweep.out / "summary-ablation.md").write_text(note + "\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
