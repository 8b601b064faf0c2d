"""Does llama.cpp run specft's drafts the way `specft eval` measures them, on the GGUF it serves?

For a run trained against a GGUF target (`model.path=FILE.gguf quant=checkpoint`): export
the draft as GGUF (`specft export --layout gguf`), decode the same prompts greedily with
specft's engine (its emulation of the GGUF, the code `specft eval` runs, batch 1) and with
llama-server (one slot), target alone and at each k, and print side by side: drafted and
accepted tokens (llama.cpp's own counters), the acceptance rate, whether each engine's
speculative output equals its own target-alone output (and the flip rate where not), where
the two engines' target-alone outputs first differ, and tokens/s. Then the kernel-path
diagnosis: llama.cpp's logits for its own target-alone outputs fed one token per decode
(the path target-alone decoding takes) against k+1 tokens per decode (a verify pass), and
specft's emulation against both. Writes JSON and the table under --out.

    python scripts/checks/check_llamacpp.py RUN_DIR --ks 3 4 5 --num-prompts 16 --max-new-tokens 64
    python scripts/checks/check_llamacpp.py RUN_DIR --target other.gguf   # the same draft on another GGUF
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from specft.eval.runner import divergence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_vllm import run_config, specft_side  # noqa: E402


def llamacpp_side(target: Path, draft: Path, prompts: list[list[int]], ks: list[int], max_new_tokens: int,
                  threads: int) -> list[dict]:
    """llama-server with one slot: target alone, then the draft at each k."""
    from specft.llamacpp.server import LlamaServer, ServerOptions

    runs = []
    for k in [0, *ks]:
        options = ServerOptions(target, draft if k else None, draft_n=k or 3, threads=threads)
        with LlamaServer(options) as server:
            server.complete(prompts[0], 4)  # warm-up
            tokens, drafted, accepted, start = [], 0, 0, time.perf_counter()
            for ids in prompts:
                out = server.complete(ids, max_new_tokens)
                tokens.append(out["tokens"])
                drafted += out["timings"].get("draft_n", 0)
                accepted += out["timings"].get("draft_n_accepted", 0)
            seconds = time.perf_counter() - start
        runs.append({"k": k, "tokens": tokens, "seconds": seconds, "generated": sum(map(len, tokens)),
                     "proposed": drafted, "accepted": accepted})
        print(f"llama.cpp k={k}: {runs[-1]['generated']} tokens in {seconds:.1f} s", flush=True)
    return runs


def summarize(engine: str, run: dict, alone: dict) -> dict:
    flips = divergence(run["tokens"], alone["tokens"])
    proposed, accepted = run.get("proposed", 0), run.get("accepted", 0)
    return {"engine": engine, "k": run["k"], "proposed": proposed, "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "equals_target_alone": flips["rows_diverged"] == 0, "rows_diverged": flips["rows_diverged"],
            "flip_rate": flips["flip_rate"], "generated": run["generated"],
            "tokens_per_s": run["generated"] / run["seconds"]}


def kernel_paths(target: Path, prompts: list[list[int]], outputs: list[list[int]], k: int, cfg) -> dict:
    """llama.cpp's logits on its own target-alone continuations, one token per decode
    (decoding) against k+1 per decode (a verify pass), and specft's emulation (one batch
    of the whole sequence) against the one-token path: argmax flips and logit errors."""
    from specft.llamacpp.probe import run_probe
    from specft.quant import apply_quant
    from specft.target_model import load_target

    sequences = [p + o for p, o in zip(prompts, outputs) if o]
    starts = [len(p) for p, o in zip(prompts, outputs) if o]
    one = run_probe(target, sequences, ubatch=1)
    verify = run_probe(target, sequences, ubatch=k + 1)
    model, _ = load_target(cfg.model)
    apply_quant(model, cfg.quant)
    ours = []
    with torch.no_grad():
        for s in sequences:
            ours.append(model(torch.tensor([s])).logits[0].float().numpy())

    def compare(a_all, b_all):
        flips = total = 0
        errors = []
        for a, b, start in zip(a_all, b_all, starts):
            a, b = a[start - 1:-1], b[start - 1:-1]  # the rows that chose the continuation
            flips += int((a.argmax(-1) != b.argmax(-1)).sum())
            total += len(a)
            errors.append(np.abs(a - b))
        err = np.concatenate([e.ravel() for e in errors])
        return {"argmax_flips": flips, "positions": total, "max_logit_error": float(err.max()),
                "mean_logit_error": float(err.mean())}

    return {"verify_batch": k + 1, "llamacpp_batch_vs_one_token": compare(verify.logits, one.logits),
            "specft_vs_llamacpp_one_token": compare(ours, one.logits),
            "specft_vs_llamacpp_batch": compare(ours, verify.logits)}


def table(rows: list[dict]) -> str:
    lines = ["| engine | k | drafted | accepted | rate | = target alone | flip rate | tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = "yes" if r["equals_target_alone"] else f"no ({r['rows_diverged']} rows)"
        lines.append(f"| {r['engine']} | {r['k']} | {r['proposed']} | {r['accepted']} | {r['acceptance_rate']:.3f} | "
                     f"{same} | {100 * r['flip_rate']:.2f}% | {r['tokens_per_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    from specft.eval.drafts import resolve_checkpoint
    from specft.export.gguf import DRAFT_FILE, check_pair, export_gguf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a specft run trained with model.path=FILE.gguf quant=checkpoint")
    ap.add_argument("--target", type=Path, default=None, help="the GGUF to serve (default: the run's model.path)")
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 4, 5])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=None, help="default: RUN/check_llamacpp")
    ap.add_argument("overrides", nargs="*", help="fields of the run's config for the prompts, e.g. data.name=gsm8k")
    args = ap.parse_intermixed_args()

    run_dir = args.run.resolve()
    out = (args.out or run_dir / "check_llamacpp").resolve()
    target_override = [f"model.path={args.target.resolve()}"] if args.target else []
    cfg = run_config(run_dir, [f"eval.num_prompts={args.num_prompts}", f"eval.max_new_tokens={args.max_new_tokens}",
                               *target_override, *args.overrides])
    target = Path(cfg.model.path)
    if target.suffix != ".gguf" or not cfg.quant.from_checkpoint:
        raise SystemExit("error: the run's target is not a GGUF run as a checkpoint (model.path=FILE.gguf "
                         "quant=checkpoint); give --target FILE.gguf")
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = resolve_checkpoint(run_dir, "run")
    draft = export_gguf(checkpoint, out / "draft", target=target, overwrite=True) / DRAFT_FILE
    check_pair(target, draft)

    torch.set_num_threads(args.threads)
    prompts, specft_runs = specft_side(cfg, target, checkpoint, args.ks, 1, "none")
    llama_runs = llamacpp_side(target, draft, prompts, args.ks, args.max_new_tokens, args.threads)
    rows = [summarize(engine, r, runs[0]) for engine, runs in (("specft", specft_runs), ("llama.cpp", llama_runs))
            for r in runs]
    between = divergence(specft_runs[0]["tokens"], llama_runs[0]["tokens"])
    agree = [i for i, (a, b) in enumerate(zip(specft_runs[0]["tokens"], llama_runs[0]["tokens"])) if a == b]
    paths = kernel_paths(target, prompts, llama_runs[0]["tokens"], max(args.ks), cfg)
    result = {"run": str(run_dir), "target": str(target), "draft": str(draft), "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "threads": args.threads,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
              "target_alone_divergence": between, "prompts_identical_target_alone": agree,
              "kernel_paths": paths, "rows": rows,
              "per_prompt": {"specft": [list(map(len, r["tokens"])) for r in specft_runs],
                             "llama.cpp": [list(map(len, r["tokens"])) for r in llama_runs]}}
    kp = paths["llamacpp_batch_vs_one_token"]
    md = (f"{table(rows)}\n\nTarget alone, specft's emulation vs llama.cpp: {between['rows_diverged']} of "
          f"{between['rows']} outputs differ; first differing token at {100 * between['flip_rate']:.2f}% of compared "
          f"tokens.\nllama.cpp, {paths['verify_batch']} tokens per decode vs one: {kp['argmax_flips']} argmax flips "
          f"in {kp['positions']} positions, logits max {kp['max_logit_error']:.3g} mean {kp['mean_logit_error']:.3g}.\n"
          f"specft vs llama.cpp one token per decode: {paths['specft_vs_llamacpp_one_token']}\n"
          f"specft vs llama.cpp {paths['verify_batch']} per decode: {paths['specft_vs_llamacpp_batch']}\n")
    (out / "check_llamacpp.json").write_text(json.dumps(result, indent=2))
    (out / "check_llamacpp.md").write_text(md)
    print(md)
    print(f"wrote {out / 'check_llamacpp.json'}")


if __name__ == "__main__":
    sys.exit(main())
