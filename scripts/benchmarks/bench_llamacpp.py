"""Speed in the engine: llama-server serving a GGUF target alone and with each draft, side by side.

For every target GGUF, draft (a run, exported with `specft export --layout gguf`, or a
draft .gguf) and k, at one slot (batch 1) and at 16 concurrent requests (-np 16,
continuous batching): generated tokens/s (min, median and max over --repeats runs, the
configurations alternating within each repeat so the machine's drift hits all alike),
generated tokens per CPU-second of the server (robust to other jobs with one server
thread), acceptance from llama.cpp's own counters (draft_n, draft_n_accepted), and the
server's peak RSS. A draft may also be llama.cpp's draft-free speculation
(NAME=ngram:ngram-simple); --ubatch sets -ub (the draft context's buffers scale with it);
--reference-target pairs each target's acceptance with the same draft's on one target
(what a GGUF type costs a draft). Ratios are against the target alone and against the first draft (the usual
recipe) in the same run. Prints a table and writes bench_llamacpp.json (per-prompt token
counts included).

    python scripts/benchmarks/bench_llamacpp.py --targets q4km=Q4_K_M.gguf q4_0=Q4_0.gguf \
        --drafts baseline_16bit=runs/base specft=runs/ours --prompts-run runs/ours --ks 3 4 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checks"))  # check_vllm


NGRAM = "ngram:"  # --drafts NAME=ngram:<llama-server --spec-type>: draft-free speculation


def draft_file(spec: str, out: Path, name: str, target: Path) -> Path | str:
    """A draft .gguf as given, or a run exported to one (once), with ``target``'s vocabulary
    (a draft trained on the 16-bit model records no GGUF of its own); ``ngram:TYPE`` as is."""
    from specft.eval.drafts import resolve_checkpoint
    from specft.export.gguf import DRAFT_FILE, export_gguf

    if spec.startswith(NGRAM):
        return spec
    path = Path(spec)
    if path.suffix == ".gguf":
        return path
    done = out / f"draft-{name}" / DRAFT_FILE
    if not done.exists():
        export_gguf(resolve_checkpoint(path, "draft"), done.parent, target=target, overwrite=True)
    return done


def machine() -> str:
    from specft.llamacpp.install import machine_isa

    names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
             if ln.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    return (f"{names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{' '.join(sorted(machine_isa()))}")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """The server's user + system CPU time so far, all its threads: with one server thread
    this is the work a configuration costs, whatever else runs on the machine."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def tight_context(prompts: list[list[int]], max_new_tokens: int) -> int:
    """The least context per slot a run needs: its longest prompt and answer (the target's KV,
    and so the target alone's memory, smallest)."""
    return max(map(len, prompts)) + max_new_tokens + 16


def serve(target: Path, draft: Path | None, k: int, slots: int, prompts: list[list[int]], max_new_tokens: int,
          threads: int, spec_type: str = "draft-eagle3", extra: list[str] | None = None, p_min: float = 0.0,
          ctx_per_slot: int | None = None) -> dict:
    from specft.llamacpp.server import LlamaServer, ServerOptions

    if isinstance(draft, str) and draft.startswith(NGRAM):
        draft, spec_type = None, draft.removeprefix(NGRAM)
    options = ServerOptions(target, draft, spec_type=spec_type, draft_n=k, slots=slots, threads=threads, p_min=p_min,
                            ctx_per_slot=ctx_per_slot or tight_context(prompts, max_new_tokens),
                            extra=list(extra or []))
    with LlamaServer(options) as server:
        server.complete(prompts[0], 8)  # warm-up
        cpu_start, start = cpu_seconds(server.process.pid), time.perf_counter()
        with ThreadPoolExecutor(max_workers=slots) as pool:
            outs = list(pool.map(lambda ids: server.complete(ids, max_new_tokens), prompts))
        seconds = time.perf_counter() - start
        cpu = cpu_seconds(server.process.pid) - cpu_start
        rss = peak_rss_mb(server.process.pid)
    generated = [len(o["tokens"]) for o in outs]
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": sum(generated), "tokens_per_s": sum(generated) / seconds,
            "tokens_per_cpu_s": sum(generated) / cpu if cpu > 0 else float("nan"),
            "drafted": sum(o["timings"].get("draft_n", 0) for o in outs),
            "accepted": sum(o["timings"].get("draft_n_accepted", 0) for o in outs),
            "peak_rss_mb": rss, "per_prompt_tokens": generated,
            "per_prompt_drafted_accepted": [[o["timings"].get("draft_n", 0), o["timings"].get("draft_n_accepted", 0)]
                                            for o in outs],
            # llama-server's own split of each request: its prompt's processing, then its
            # decode (the tokens after the first and the wall time they took, other slots' work
            # included): the decode is what a draft changes, the prompt's share is the same for all
            "per_prompt_decode_tokens_ms": [[o["timings"].get("predicted_n", 0), o["timings"].get("predicted_ms", 0.0)]
                                            for o in outs]}


def decode_tokens_per_s(runs: list[dict]) -> float:
    """Generated tokens per second of each request's own decode, over all requests and runs
    (1 / time per output token): at one slot the server's decode speed, at several the
    speed each request sees under the others' load. Runs saved before it was kept: nan."""
    pairs = [pair for run in runs for pair in run.get("per_prompt_decode_tokens_ms", [])]
    milliseconds = sum(ms for _, ms in pairs)
    return 1000.0 * sum(n for n, _ in pairs) / milliseconds if milliseconds > 0 else float("nan")


def load_prompts(run: Path, num: int, overrides: list[str]) -> list[list[int]]:
    from check_vllm import run_config

    from specft.eval.prompts import load_prompts as eval_prompts
    from specft.target_model import load_tokenizer

    cfg = run_config(run.resolve(), [f"eval.num_prompts={num}", *overrides])
    prompts, _ = eval_prompts(cfg, load_tokenizer(cfg.model))
    return prompts[:num]


def summarize(name: str, runs: list[dict]) -> dict:
    speeds = [r["tokens_per_s"] for r in runs]
    drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
    per_cpu_s = [r.get("tokens_per_cpu_s", float("nan")) for r in runs]  # runs saved before it was counted: nan
    return {"config": name, "tok_s_min": min(speeds), "tok_s_median": statistics.median(speeds),
            "tok_cpu_s_median": statistics.median(per_cpu_s), "decode_tok_s": decode_tokens_per_s(runs),
            "tok_s_max": max(speeds), "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "runs": runs}


def effective_batch(batch: int | None, slots: int, k: int) -> int | None:
    """-b as given, raised to slots * (k + 1) where it is lower: llama-server verifies every
    slot's sampled token and draft in one batch of -b tokens, so a smaller -b lets fewer than
    `slots` sequences draft in a round (-b 32 at k=3: 8 of 16) and, unpatched, aborted the
    server when a draft overflowed it (scripts/llamacpp_patches/0003-*, docs/serving.md)."""
    return max(batch, slots * (k + 1)) if batch else None


def batch_flags(ubatch: int | None, batch: int | None) -> list[str] | None:
    """llama-server's -ub / -b (the draft context takes the target's)."""
    flags = (["-ub", str(ubatch)] if ubatch else []) + (["-b", str(batch)] if batch else [])
    return flags or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", nargs="+", help="NAME=FILE.gguf")
    ap.add_argument("--drafts", nargs="+", help="NAME=RUN_DIR, NAME=DRAFT.gguf or NAME=ngram:SPEC_TYPE "
                    "(llama.cpp's draft-free ngram-simple, ngram-mod, ...); the first is the reference")
    ap.add_argument("--prompts-run", type=Path, help="a run whose eval prompts are decoded")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 4, 5])
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--p-min", type=float, default=0.0, help="llama-server --spec-draft-p-min: 0 drafts k every "
                    "round; above, dynamic draft length (acceptance CIs then count rounds as drafted / k)")
    ap.add_argument("--ubatch", type=int, default=None, help="llama-server -ub (the draft context takes "
                    "the target's: its compute buffer grows with it; docs/serving.md)")
    ap.add_argument("--batch", type=int, default=None, help="llama-server -b (the logical batch: the draft "
                    "context sizes its buffers by it too; with --ubatch 32, -b 32 keeps the draft's memory lowest); "
                    "raised to slots * (k + 1) where lower, so every slot drafts every round")
    ap.add_argument("--ctx-per-slot", type=int, default=None, help="llama-server's context per slot (-c is "
                    "this times the slots); default: the longest prompt and its answer, the least a run needs. "
                    "The target's KV grows with it, the draft's one-layer KV little: a user's context (2048) "
                    "makes the draft's share of the memory smaller than the tight default")
    ap.add_argument("--reference-target", default=None, help="a --targets NAME: every other target's "
                    "acceptance is also compared with each draft's on it (what a type costs a draft)")
    ap.add_argument("--acceptance-only", action="store_true", help="serve no target alone (what each type "
                    "costs a draft in acceptance; no speed ratios)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_llamacpp"))
    ap.add_argument("overrides", nargs="*", help="fields of the prompts run's config, e.g. data.name=gsm8k")
    ap.add_argument("--from-json", type=Path, default=None, help="a saved bench_llamacpp.json: recompute its "
                    "comparisons and table into --out without serving anything")
    args = ap.parse_intermixed_args()
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        result.setdefault("reference", next(iter(result["drafts"])))
        result["reference_target"] = args.reference_target or result.get("reference_target")
        return write(result, args.out)
    if not (args.targets and args.drafts and args.prompts_run):
        ap.error("--targets, --drafts and --prompts-run are required (or --from-json)")

    from specft.export.gguf import check_pair
    from specft.llamacpp.install import check_install, install_record

    check_install()
    args.out.mkdir(parents=True, exist_ok=True)
    targets = dict(t.split("=", 1) for t in args.targets)
    first_target = Path(next(iter(targets.values())))
    drafts = {name: draft_file(spec, args.out, name, first_target)
              for name, spec in (d.split("=", 1) for d in args.drafts)}
    for t in targets.values():
        for d in drafts.values():
            if not isinstance(d, str):
                check_pair(Path(t), d)
    prompts = load_prompts(args.prompts_run, args.num_prompts, args.overrides)
    alone = [] if args.acceptance_only else [(t, None, 0) for t in targets]
    configs = alone + [(t, d, k) for t in targets for d in drafts for k in args.ks]
    runs: dict[tuple, list] = {}
    for repeat in range(args.repeats):
        for slots in args.slots:
            for t, d, k in configs:
                batch = effective_batch(args.batch, slots, k)
                r = serve(Path(targets[t]), drafts[d] if d else None, k, slots, prompts, args.max_new_tokens,
                          args.threads, extra=batch_flags(args.ubatch, batch), p_min=args.p_min,
                          ctx_per_slot=args.ctx_per_slot)
                r["batch"] = batch
                runs.setdefault((t, d, k, slots), []).append(r)
                print(f"repeat {repeat} {t} {d or 'alone'} k={k} np={slots}: {r['tokens_per_s']:.1f} tok/s"
                      + (f", accepted {r['accepted']}/{r['drafted']}" if d else ""), flush=True)
    rows = []
    for (t, d, k, slots), rs in runs.items():
        row = {"target": t, "draft": d or "alone", "k": k, "slots": slots, **summarize(d or "alone", rs)}
        rows.append(row)
    result = {"machine": machine(),
              "llamacpp": install_record(), "threads": args.threads, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "ubatch": args.ubatch,
              "ctx_per_slot": args.ctx_per_slot,
              "batch": args.batch,
              "p_min": args.p_min,
              "targets": targets,
              "drafts": {k: str(v) for k, v in drafts.items()}, "reference": next(iter(drafts)),
              "reference_target": args.reference_target, "rows": rows}
    write(result, args.out)


def per_prompt(row: dict) -> list[list[int]]:
    """[rounds, proposed, accepted] per prompt, summed over the repeats (as the row's
    acceptance is), the form specft.eval.stats takes. llama.cpp reports no rounds; with
    --spec-draft-n-min 0 and p-min 0 a round drafts k, so rounds = drafted / k."""
    counts = np.sum([run["per_prompt_drafted_accepted"] for run in row["runs"]], axis=0)
    return [[-(-int(drafted) // row["k"]), int(drafted), int(accepted)] for drafted, accepted in counts]


def _ratio(row: dict, other: dict | None, key: str) -> float:
    """row[key] / other[key]; nan where either lacks it (runs saved before it was kept)."""
    nan = float("nan")
    return row.get(key, nan) / other.get(key, nan) if other else nan


def add_comparisons(result: dict) -> None:
    """Each draft row against the reference draft on the same target, k and slots: speed and
    RSS ratios, and its acceptance with a 95% bootstrap CI over prompts, paired with the
    reference's on the same prompts (specft.eval.stats, as `specft eval` reports them)."""
    from specft.eval.stats import confidence, paired_difference

    rows = result["rows"]
    index = {(r["target"], r["draft"], r["k"], r["slots"]): r for r in rows}
    for row in rows:
        alone = index.get((row["target"], "alone", 0, row["slots"]))
        # wall time and, robust to other jobs, CPU time of the one-thread server
        for name, key in [("speedup_vs_alone", "tok_s_median"), ("cpu_speedup_vs_alone", "tok_cpu_s_median"),
                          ("rss_vs_alone", "peak_rss_mb")]:
            row[name] = _ratio(row, alone, key)
        if row["draft"] == "alone":
            continue
        ref = index[(row["target"], result["reference"], row["k"], row["slots"])]
        for name, key in [("speed_vs_reference", "tok_s_median"), ("cpu_speed_vs_reference", "tok_cpu_s_median"),
                          ("decode_speed_vs_reference", "decode_tok_s"), ("rss_vs_reference", "peak_rss_mb")]:
            row[name] = _ratio(row, ref, key)
        row["acceptance_ci"] = confidence(per_prompt(row), seed=0)["acceptance_rate_ci"]
        if row is not ref:
            diff = paired_difference(per_prompt(ref), per_prompt(row), seed=0)
            row["acceptance_vs_reference"] = [diff["rate_difference"], *diff["rate_difference_ci"]]
        # what a target type costs a draft: its acceptance against the same draft's on the
        # reference target (the 16-bit model), paired over the same prompts
        base = index.get((result.get("reference_target"), row["draft"], row["k"], row["slots"]))
        if base is not None and base is not row:
            diff = paired_difference(per_prompt(base), per_prompt(row), seed=0)
            row["acceptance_vs_reference_target"] = [diff["rate_difference"], *diff["rate_difference_ci"]]


def type_cost_table(result: dict) -> str:
    """Per draft and target type: acceptance and its paired difference from the same draft
    on the reference target."""
    lines = [f"| target | draft | k | slots | acceptance [95% CI] | - {result['reference_target']} [95% CI] |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["draft"] == "alone":
            continue
        lo, hi = r["acceptance_ci"]
        d = r.get("acceptance_vs_reference_target")
        diff = f"{100 * d[0]:+.1f} pts [{100 * d[1]:+.1f}, {100 * d[2]:+.1f}]" if d else "-"
        lines.append(f"| {r['target']} | {r['draft']} | {r['k']} | {r['slots']} | {r['acceptance']:.3f} [{lo:.3f}, "
                     f"{hi:.3f}] ({r['accepted']}/{r['drafted']}) | {diff} |")
    return "\n".join(lines)


def table(result: dict) -> str:
    nan = float("nan")
    lines = ["| target | draft | k | slots | tok/s min / median / max | tok per CPU-s | decode tok/s per request "
             "(x recipe) | x alone (wall / CPU) | x recipe (wall / CPU) | acceptance [95% CI] | "
             "acceptance - recipe [95% CI] | peak RSS MB | RSS x alone |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        acc, diff = "-", "-"
        if r["acceptance"] is not None:
            lo, hi = r["acceptance_ci"]
            acc = f"{r['acceptance']:.3f} [{lo:.3f}, {hi:.3f}] ({r['accepted']}/{r['drafted']})"
        if "acceptance_vs_reference" in r:
            d, lo, hi = r["acceptance_vs_reference"]
            diff = f"{100 * d:+.1f} pts [{100 * lo:+.1f}, {100 * hi:+.1f}]"
        lines.append(f"| {r['target']} | {r['draft']} | {r['k'] or '-'} | {r['slots']} | {r['tok_s_min']:.1f} / "
                     f"{r['tok_s_median']:.1f} / {r['tok_s_max']:.1f} | {r.get('tok_cpu_s_median', nan):.1f} | "
                     f"{r.get('decode_tok_s', nan):.1f} ({r.get('decode_speed_vs_reference', nan):.3f}) | "
                     f"{r['speedup_vs_alone']:.2f} / {r.get('cpu_speedup_vs_alone', nan):.2f} | "
                     f"{r.get('speed_vs_reference', nan):.3f} / {r.get('cpu_speed_vs_reference', nan):.3f} | "
                     f"{acc} | {diff} "
                     "| "
                     f"{r['peak_rss_mb']:.0f} | {r['rss_vs_alone']:.3f} |")
    return "\n".join(lines)


def write(result: dict, out: Path) -> None:
    add_comparisons(result)
    md = table(result)
    if result.get("reference_target"):
        md += "\n\n" + type_cost_table(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_llamacpp.json").write_text(json.dumps(result, indent=2))
    (out / "bench_llamacpp.md").write_text(md + "\n")
    print(md)
    print(f"wrote {out / 'bench_llamacpp.json'}")


if __name__ == "__main__":
    sys.exit(main())
