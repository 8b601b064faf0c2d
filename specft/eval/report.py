"""Eval reports: results.json, results.md (a table people read) and two PNG plots."""

from __future__ import annotations

import json
from pathlib import Path


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:+.1f}%"


def _ci(x: float, ci: list[float] | None, fmt: str) -> str:
    return f"{x:{fmt}}" if ci is None else f"{x:{fmt}} [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def verdict(c: dict) -> str:
    if not c["distinguishable"]:
        return "no difference (the CI includes 0)"
    return f"{c['b'] if c['rate_difference'] > 0 else c['a']} higher"


def comparison_lines(comparisons: list[dict]) -> list[str]:
    if not comparisons:
        return []
    lines = ["", "Paired differences (b - a, same prompts, 95% bootstrap CI over prompts):", "",
             "| k | batch | a | b | accept rate b - a | accept len b - a | verdict |", "|---|---|---|---|---|---|---|"]
    for c in comparisons:
        lines.append(f"| {c['k']} | {c['batch_size']} | {c['a']} | {c['b']} | "
                     f"{_ci(c['rate_difference'], c['rate_difference_ci'], '+.3f')} | "
                     f"{_ci(c['length_difference'], c['length_difference_ci'], '+.2f')} | {verdict(c)} |")
    return lines


def _left_out(meta: dict) -> str:
    """Records of the data set that gave no prompt, by reason (other_split: the train
    side of a split; over_cap: past eval.num_prompts)."""
    left = meta.get("prompts_left_out") or {}
    return (" Records left out: " + ", ".join(f"{v} {k}" for k, v in left.items()) + ".") if left else ""


def markdown(records: list[dict], meta: dict, comparisons: list[dict] = ()) -> str:
    lines = [f"# specft eval: {meta['model']} / {meta['quant']}", "",
             f"{meta['prompts']} prompts from data={meta['data']} (split {meta['split']}), "
             f"max {meta['max_new_tokens']} new tokens, temperature {meta['temperature']}, "
             f"{meta['dtype']}, {meta['torch_threads']} threads.{_left_out(meta)}", "",
             "| draft | k | batch | accept rate | accept len | ms/token | tok/s | latency vs first draft "
             "| latency vs target alone | memory vs target alone | flip rate |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        flips = f"{r['flip_rate']:.4f} ({r['rows_diverged']}/{r['rows']} rows)" if "flip_rate" in r else ""
        lines.append(
            f"| {r['draft']} | {r['k']} | {r['batch_size']} | "
            f"{_ci(r['acceptance_rate'], r.get('acceptance_rate_ci'), '.3f')} | "
            f"{_ci(r['acceptance_length'], r.get('acceptance_length_ci'), '.2f')} | "
            f"{r['latency_ms_per_token']:.1f} | {r['tokens_per_s']:.1f} | "
            f"{_pct(r.get('latency_change_vs_first'))} | {_pct(r.get('latency_change_vs_target_alone'))} | "
            f"{_pct(r.get('memory_vs_target_alone'))} | {flips} |")
    lines += comparison_lines(list(comparisons))
    lines += ["", "accept rate: accepted / proposed draft tokens, [95% bootstrap CI over prompts]. "
              "accept len: tokens emitted per target forward. latency: decode time per output token of one "
              "sequence; vs first draft: "
              "(T_first - T) / T_first. memory: weights + peak KV caches. flip rate: first "
              "divergences from the target-alone greedy output per compared token.", "",
              "![acceptance by position](acceptance_by_position.png)", "",
              "![latency by k](latency_by_k.png)", ""]
    return "\n".join(lines)


def plots(out_dir: Path, records: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafts = [r for r in records if r["k"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["draft"] for r in drafts):
        mine = [r for r in drafts if r["draft"] == label]
        best = max(mine, key=lambda r: (r["k"], -r["batch_size"]))
        ax.plot(range(1, best["k"] + 1), best["acceptance_at"], marker="o",
                label=f"{label} (k={best['k']}, batch {best['batch_size']})")
    ax.set(xlabel="draft position", ylabel="share of proposals accepted", ylim=(0, 1.02),
           title="Acceptance by position")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance_by_position.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, batch in dict.fromkeys((r["draft"], r["batch_size"]) for r in records):
        mine = sorted((r for r in records if r["draft"] == label and r["batch_size"] == batch), key=lambda r: r["k"])
        if len(mine) == 1 and mine[0]["k"] == 0:
            ax.axhline(mine[0]["latency_ms_per_token"], linestyle="--", color="gray",
                       label=f"target alone (batch {batch})")
        else:
            ax.plot([r["k"] for r in mine], [r["latency_ms_per_token"] for r in mine], marker="o",
                    label=f"{label} (batch {batch})")
    ax.set(xlabel="draft length k", ylabel="ms per output token", title="Decode latency by k")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "latency_by_k.png", dpi=120)
    plt.close(fig)


def write_reports(out_dir: Path, records: list[dict], meta: dict, comparisons: list[dict] = ()) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "results": records,
                                                      "comparisons": list(comparisons)}, indent=2))
    table = markdown(records, meta, comparisons)
    (out_dir / "results.md").write_text(table)
    plots(out_dir, records)
    print(table.split("\n\n![")[0])
    print(f"\nreports: {out_dir}/results.md, results.json, acceptance_by_position.png, latency_by_k.png")
