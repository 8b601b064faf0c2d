"""Issue 34: where does the served target's own answer differ from the fixed text?

A draft trained on fixed text (data.regenerate.enabled=false) learns the target's
distribution over answers the target did not write; regenerating an answer changes the
text only where the target would have written something else. This reads the stage-1
cache of a fixed-text run and, with the target's lm_head stored in it, scores every
answer position: is the target's greedy next token the text's next token? Per source
(GSM8K reference solutions, ShareGPT replies) it reports that top-1 agreement with a 95%
bootstrap CI over conversations, and how many answer tokens the target's greedy answer
would share with the text before they part (the first answer of each conversation).
Where agreement is low, the target's answers differ most, and regenerating pays most.

    python scripts/checks/text_agreement.py --run-dir runs/dph/arm-fixed/ours-mxfp4 \\
        --out docs/results/data_per_hour/agreement.json

Each conversation's source is found by tokenizing every member of the run's data.mix as
stage 1 did and matching token ids. Prints a table; the JSON keeps per-conversation counts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm


def _fingerprint(ids) -> str:
    return hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


def source_of_samples(cfg) -> dict[str, str]:
    """Token-id fingerprint -> the data.mix member (or data.name) the conversation came from."""
    from specft.cache import locate_cache
    from specft.data import mix_members
    from specft.data.records import DataSummary
    from specft.data.select import select_conversations, with_system_prompt
    from specft.data.sources import DATA_SOURCES
    from specft.data.template import tokenize_conversation

    _, _, tokenizer = locate_cache(cfg)
    members = mix_members(cfg.data) if cfg.data.name == "mix" else [cfg.data]
    sources = {}
    for member in members:
        convs = select_conversations(DATA_SOURCES.get(member.name, "data.name")(member, DataSummary()), member,
                                     DataSummary())
        for conv in convs:
            sample, _ = tokenize_conversation(tokenizer, with_system_prompt(conv, cfg.data.system_prompt),
                                              cfg.data.max_seq_len, cfg.data.thinking)
            if sample is not None:
                sources[_fingerprint(sample.input_ids)] = member.name
    return sources


def first_run(mask: torch.Tensor) -> slice:
    """The first contiguous stretch of True in ``mask`` (the first answer)."""
    where = mask.nonzero().flatten().tolist()
    if not where:
        return slice(0, 0)
    end = where[0]
    while end + 1 < len(mask) and mask[end + 1]:
        end += 1
    return slice(where[0], end + 1)


def score_sample(sample: dict, head: torch.Tensor, chunk: int) -> dict:
    """Answer positions, how many the target's argmax predicts, and the length of the
    first answer's agreeing prefix (tokens before the target's greedy answer parts)."""
    from specft.train.target_head import chunked_stats

    _, _, argmax = chunked_stats(sample["final_hidden"].float(), head, chunk)
    answer = sample["loss_mask"][1:] > 0  # position t predicts answer token t+1
    hits = (argmax[:-1] == sample["input_ids"][1:]) & answer
    first = hits[first_run(answer)]
    misses = (~first).nonzero()
    return {"answer_tokens": int(answer.sum()), "agreeing": int(hits.sum()), "first_answer_tokens": len(first),
            "first_answer_shared_prefix": int(misses[0, 0]) if len(misses) else len(first)}


def bootstrap_ci(hits: np.ndarray, totals: np.ndarray, seed: int = 0, draws: int = 2000) -> list[float]:
    """95% percentile interval of sum(hits)/sum(totals), resampling conversations."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(hits), size=(draws, len(hits)))
    rates = hits[picks].sum(1) / np.maximum(totals[picks].sum(1), 1)
    return [float(np.quantile(rates, 0.025)), float(np.quantile(rates, 0.975))]


def summarize(rows: list[dict]) -> dict:
    out = {}
    for source in sorted({r["source"] for r in rows}):
        mine = [r for r in rows if r["source"] == source]
        hits = np.array([r["agreeing"] for r in mine])
        totals = np.array([r["answer_tokens"] for r in mine])
        prefix = np.array([r["first_answer_shared_prefix"] for r in mine])
        first = np.array([r["first_answer_tokens"] for r in mine])
        out[source] = {"conversations": len(mine), "answer_tokens": int(totals.sum()),
                       "top1_agreement": float(hits.sum() / max(totals.sum(), 1)),
                       "top1_agreement_ci": bootstrap_ci(hits, totals),
                       "mean_shared_prefix": float(prefix.mean()), "mean_first_answer_tokens": float(first.mean()),
                       "whole_first_answer_shared": float((prefix == first).mean())}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, required=True, help="a fixed-text specft train run (its config.yaml)")
    p.add_argument("--out", type=Path, required=True, help="JSON to write")
    p.add_argument("--max-samples", type=int, default=0, help="score the first N cached conversations (0: all)")
    p.add_argument("--vocab-chunk", type=int, default=16384)
    a = p.parse_args()

    from omegaconf import OmegaConf

    from specft.cache import CacheReader, locate_cache
    from specft.commands.validate import to_schema

    cfg = to_schema(OmegaConf.load(a.run_dir / "config.yaml"))
    if cfg.data.regenerate.enabled and cfg.data.regenerate.fraction in (None, 1, 1.0):
        raise SystemExit(f"{a.run_dir}: its answers were regenerated by the target; give a fixed-text run")
    cache_dir, _, _ = locate_cache(cfg)
    reader = CacheReader(cache_dir)
    head = reader.target_head_rows(0, reader.target_head_vocab()).float()
    sources = source_of_samples(cfg)
    count = min(len(reader), a.max_samples or len(reader))
    rows = []
    with torch.no_grad():
        for i in tqdm(range(count), desc="score", unit="conv", mininterval=10):
            sample = reader[i]
            source = sources.get(_fingerprint(sample["input_ids"]), "unmatched")
            rows.append({"index": i, "source": source, **score_sample(sample, head, a.vocab_chunk)})
    summary = summarize(rows)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"run_dir": str(a.run_dir), "cache": str(cache_dir), "by_source": summary,
                                 "per_conversation": rows}, indent=1))
    print("| source | conversations | answer tokens | target top-1 = text [95% CI] | shared prefix of the first "
          "answer, tokens (of) | first answer wholly shared |")
    print("|---|---|---|---|---|---|")
    for source, s in summary.items():
        lo, hi = s["top1_agreement_ci"]
        print(f"| {source} | {s['conversations']} | {s['answer_tokens']:,} | {s['top1_agreement']:.3f} "
              f"[{lo:.3f}, {hi:.3f}] | {s['mean_shared_prefix']:.1f} ({s['mean_first_answer_tokens']:.1f}) | "
              f"{100 * s['whole_first_answer_shared']:.1f}% |")


if __name__ == "__main__":
    main()
