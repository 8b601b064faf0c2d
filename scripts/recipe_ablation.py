"""Issue 15, part 4: recipe ablations at a fixed budget, scored by the trainer's replayed
validation (the held-out prompts' greedy decoding, which lands on `specft eval`'s count;
docs/results.md), with 95% CIs and paired differences against the reference recipe.

    python scripts/recipe_ablation.py --out-dir runs/vocab_sweep    # reuses that sweep's caches

Every variant trains on the same cache and validates on the same held-out samples; only
its overrides differ. Steps resume; summary-ablation.md / .json are rewritten at the end.
"""

from __future__ import annotations

import argparse
import json

from vocab_sweep import Sweep, add_arguments

from specft.eval.stats import confidence, paired_difference

VARIANTS = {
    "reference": (),
    # The reference recipe again with another seed (init, data order, prior sampling): the
    # spread between seeds that a CI over prompts does not include.
    "seed_1": ("seed=1",),
    "seed_2": ("seed=2",),
    "ttt_3": ("draft.ttt_steps=3",),
    "ttt_7": ("draft.ttt_steps=7",),
    "loss_lk": ("loss=lk",),
    "lr_3e-3": ("trainer.lr=3e-3",),
    "lr_3e-4": ("trainer.lr=3e-4",),
    "steps_x2": ("trainer.max_steps={steps2}",),
    "noise_0.05": ("trainer.feature_noise=0.05",),
    "init_target_layer": ("draft.init=target_layer",),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--vocab", default="seen", help="the draft vocabulary every variant uses (a --sizes value)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    sweep = Sweep(args, "walls-ablation.json")
    rows, overrides = {}, {}
    for name in args.variants.split(","):
        extra = overrides[name] = tuple(o.format(steps2=2 * args.steps) for o in VARIANTS[name])
        run = sweep.train(args.vocab, sweep.out / f"ablation-{name}", extra)
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rows[name] = [m for m in metrics if m["split"] == "val"][-1]
    k = int(args.k)
    ref = rows["reference"][f"replay_per_prompt_k{k}"] if "reference" in rows else None
    table = []
    for name, val in rows.items():
        per = val[f"replay_per_prompt_k{k}"]
        row = {"variant": name, "overrides": list(overrides[name]), "rate": val[f"replay_accept_rate_k{k}"],
               "rate_ci": confidence(per, args.seed)["acceptance_rate_ci"], "length": val[f"replay_accept_len_k{k}"]}
        if ref is not None and name != "reference":
            row["vs_reference"] = paired_difference(ref, per, args.seed)
        table.append(row)
    (sweep.out / "summary-ablation.json").write_text(json.dumps({"k": k, "rows": table, "wall_s": sweep.steps.walls},
                                                                indent=2))
    lines = [f"| variant | overrides | replayed acceptance k={k} [95% CI] (length) | vs reference [95% CI] |",
             "|---|---|---|---|"]
    for r in table:
        d = r.get("vs_reference")
        gap = "" if d is None else (f"{100 * d['rate_difference']:+.1f} pts [{100 * d['rate_difference_ci'][0]:+.1f}, "
                                    f"{100 * d['rate_difference_ci'][1]:+.1f}]"
                                    + ("" if d["distinguishable"] else ", no difference"))
        lines.append(f"| {r['variant']} | {' '.join(r['overrides'])} | {r['rate']:.3f} [{r['rate_ci'][0]:.3f}, "
                     f"{r['rate_ci'][1]:.3f}] ({r['length']:.2f}) | {gap} |")
    (sweep.out / "summary-ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
