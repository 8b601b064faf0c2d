"""Issue 52: the target's answers from the engine that serves it (llama-server) against
specft's own engine, on SmolLM2-135M-Instruct as a Q4_K_M GGUF.

Parts (each resumes; run them in this order):

    speed   the same conversations answered three times, one engine after the other on the
            same cores: specft's engine (data.regenerate.engine=specft), llama-server with
            one slot, llama-server with --slots parallel slots. Each is one `specft cache`
            under <out>/speed-<engine>/ with a cache root of its own (nothing is reused
            between them); its regeneration tokens/s and wall come from the cache's
            data_summary, the command's wall from steps.py.
    train   the recipe of docs/results.md (GSM8K + ShareGPT-sample conversations, every
            answer regenerated, EAGLE-3, 4,096-token draft vocabulary, seed 0) on the GGUF
            target, once per --engines entry: `specft` answers with specft's engine,
            `server` with llama-server (--slots slots, started and stopped here). Give
            each engine its own lane to run the two side by side (--lanes 'train:specft;
            train:server', one core each): every wall is measured on equal terms.
    eval    one `specft eval` per held-out set (GSM8K 128 prompts, MT-Bench 80) decodes
            both drafts on the GGUF target: paired differences with 95% CIs (eval:gsm8k
            and eval:mtbench run one set each, e.g. as two lanes).

Then summary.json / summary.md: the speed table, how often and where the served answers
part from specft's (first differing token of each answer, re-tokenized by the target's
tokenizer; the share identical), both drafts' acceptance and every wall.

    python scripts/studies/served_answers.py --gguf smollm2-Q4_K_M.gguf --out-dir runs/served --parts speed
    python scripts/studies/served_answers.py --gguf ... --out-dir runs/served --lanes 'train:specft;train:server'
    python scripts/studies/served_answers.py --gguf ... --out-dir runs/served --lanes 'eval:gsm8k;eval:mtbench'

llama-server comes from `make llamacpp` ($SPECFT_LLAMACPP).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from steps import Steps, add_data_options, gsm8k_sharegpt_mix, prompt_set, rate_cell, run_lanes

SCRIPTS = Path(__file__).resolve().parent
ENGINES = ("specft", "server")


def recipe_data(a: argparse.Namespace, gsm8k: int, sharegpt: int) -> list[str]:
    return ["data=mix", gsm8k_sharegpt_mix(a.gsm8k, gsm8k, a.sharegpt, sharegpt, 4, a.sharegpt_val_fraction),
            "data.split=train", "data.val_fraction=0.1", "data.regenerate.enabled=true",
            f"data.regenerate.max_new_tokens={a.max_new_tokens}", "data.regenerate.batch_size=32",
            f"data.max_seq_len={a.max_seq_len}"]


def target(a: argparse.Namespace) -> list[str]:
    return ["model=hf", f"model.path={a.gguf.resolve()}", "quant=checkpoint"]


def llama_server(a: argparse.Namespace, slots: int):
    """llama-server (specft.llamacpp.server) on the GGUF with ``slots`` parallel slots, each
    with room for a prompt and its answer, on this process's cores; always stopped."""
    from specft.llamacpp.server import LlamaServer, ServerOptions

    threads = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
    return LlamaServer(ServerOptions(a.gguf.resolve(), None, slots=slots, threads=threads,
                                     ctx_per_slot=a.max_seq_len + a.max_new_tokens + 64))


def engine_args(engine: str, server, slots: int) -> list[str]:
    if engine == "specft":
        return []
    return ["data.regenerate.engine=server", f"data.regenerate.server.url={server.url}",
            f"data.regenerate.server.concurrency={slots}"]


# -- speed -----------------------------------------------------------------------------------

SPEED_ENGINES = {"specft": ("specft", 0), "server_1slot": ("server", 1), "server_slots": ("server", None)}


def speed(a: argparse.Namespace, steps: Steps) -> None:
    for name, (engine, slots) in SPEED_ENGINES.items():
        slots = slots or a.slots
        root = a.out_dir.resolve() / f"speed-{name}"
        done = root / "done"
        if done.exists():
            print(f"[skip] speed {name}: {done} exists", flush=True)
            continue
        with llama_server(a, slots) if engine == "server" else contextlib.nullcontext() as server:
            args = ["cache", *target(a), *recipe_data(a, a.speed_gsm8k, a.speed_sharegpt),
                    *engine_args(engine, server, slots), f"cache.root={root / 'cache'}", f"run_dir={root / 'run'}",
                    "seed=0"]
            steps.run(f"speed {name}", args, done)
        done.write_text("")


def only_cache(root: Path) -> Path:
    found = sorted(root.glob("*/manifest.json"))
    if len(found) != 1:
        raise SystemExit(f"{root}: expected one finished cache, found {len(found)}")
    return found[0].parent


def answers_of(cache_dir: Path) -> dict[int, list[str]]:
    """Each stored conversation's answers (assistant turns), by sample index."""
    from specft.data.answer_store import load_store

    out = {}
    for path in sorted(cache_dir.glob("regenerated-r*.jsonl")):
        out.update({i: [m["content"] for m in conv if m["role"] == "assistant"] for i,
                    conv in load_store(path).items()})
    return out


def divergence(tokenizer, ours: dict[int, list[str]], theirs: dict[int, list[str]]) -> dict:
    """Per answer (the same conversation and turn in both): the first token where the two
    differ (None when identical), over the re-tokenized answer texts. A conversation's later
    turns continue different histories once an earlier answer differs, so only first turns
    are compared."""
    rows = []
    for index in sorted(set(ours) & set(theirs)):
        a, b = (tokenizer(t[0], add_special_tokens=False)["input_ids"] for t in (ours[index], theirs[index]))
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        rows.append({"index": index, "first_difference": first, "tokens": [len(a), len(b)]})
    parted = sorted(r["first_difference"] for r in rows if r["first_difference"] is not None)
    return {"answers": len(rows), "identical": len(rows) - len(parted),
            "identical_share": (len(rows) - len(parted)) / len(rows) if rows else None,
            "median_first_difference": parted[len(parted) // 2] if parted else None,
            "first_difference_quartiles": [parted[len(parted) // 4],
                                           parted[(3 * len(parted)) // 4]] if parted else None,
            "per_answer": rows}


def speed_rows(a: argparse.Namespace, steps: Steps) -> list[dict]:
    rows = []
    for name, (engine, slots) in SPEED_ENGINES.items():
        root = a.out_dir.resolve() / f"speed-{name}"
        if not (root / "done").exists():
            continue
        summary = json.loads((only_cache(root / "cache") / "manifest.json").read_text())["data_summary"]
        regen_s = summary["regen_ms"] / 1000
        rows.append({"engine": name, "slots": slots or a.slots if engine == "server" else None,
                     "conversations": summary["regenerated"], "new_tokens": summary["regen_new_tokens"],
                     "regeneration_s": regen_s, "tokens_per_s": summary["regen_new_tokens"] / regen_s,
                     "command_wall_s": steps.walls.get(f"speed {name}")})
    return rows


# -- train and eval --------------------------------------------------------------------------

def run_dir(a: argparse.Namespace, engine: str) -> Path:
    return a.out_dir.resolve() / f"answers-{engine}"


def train(a: argparse.Namespace, engine: str) -> None:
    steps = Steps(a.out_dir.resolve(), f"walls-train-{engine}.json")
    run = run_dir(a, engine)
    done = run / "checkpoints" / "final"
    with llama_server(a, a.slots) if engine == "server" and not done.exists() else contextlib.nullcontext() as server:
        args = ["train", *target(a), *recipe_data(a, a.gsm8k_samples, a.sharegpt_samples),
                *engine_args(engine, server, a.slots), f"cache.root={a.out_dir.resolve() / 'cache'}",
                "draft.ttt_steps=3", "draft.vocab_size=4096", "draft.vocab_fill=prior", f"trainer.max_steps={a.steps}",
                "trainer.save_every=40", "eval.k=[3,4,5]", "eval.max_new_tokens=64", f"seed={a.seed}",
                f"run_dir={run}"]
        steps.run(f"train, answers by {engine}", args, done)


EVAL_SETS = ("gsm8k", "mtbench")


def evaluate(a: argparse.Namespace, sets: tuple[str, ...]) -> None:
    steps = Steps(a.out_dir.resolve(), "walls-eval.json")
    drafts = [(f"answers_{e}", run_dir(a, e)) for e in ENGINES]
    for data in sets:
        prompts = a.eval_prompts if data == "gsm8k" else a.mtbench_prompts
        out = a.out_dir.resolve() / f"eval-{data}"
        args = ["eval", *target(a), *prompt_set(data, a.gsm8k, a.sharegpt, a.sharegpt_val_fraction),
                f"eval.num_prompts={prompts}", "eval.max_new_tokens=64", f"eval.k=[{a.k}]", "eval.batch_sizes=[16]",
                f"eval.drafts=[{','.join(str(p) for _, p in drafts)}]",
                f"eval.labels=[{','.join(label for label, _ in drafts)}]", "eval.target_alone=false",
                f"eval.out_dir={out}", f"run_dir={drafts[-1][1]}"]
        steps.run(f"eval ({data})", args, out / "results.json")


# -- summary ---------------------------------------------------------------------------------

def walls(out: Path) -> dict:
    merged = {}
    for path in sorted(out.glob("walls*.json")):
        merged.update(json.loads(path.read_text()))
    return merged


def summarize(a: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    out = a.out_dir.resolve()
    result: dict = {"gguf": str(a.gguf), "speed": speed_rows(a, Steps(out, "walls-speed.json")),
                    "walls_s": walls(out), "divergence": {}}
    caches = {name: only_cache(out / f"speed-{name}" / "cache") for name in SPEED_ENGINES
              if (out / f"speed-{name}" / "done").exists()}
    train_caches = training_caches(out / "cache")
    tokenizer = AutoTokenizer.from_pretrained(str(a.gguf.resolve().parent), gguf_file=a.gguf.name)
    pairs = [("specft", "server_1slot", caches), ("specft", "server_slots", caches),
             ("server_1slot", "server_slots", caches), ("specft", "server", train_caches)]
    for x, y, where in pairs:
        if x in where and y in where:
            result["divergence"][f"{x} vs {y}"] = divergence(tokenizer, answers_of(where[x]), answers_of(where[y]))
    rows, comparisons = [], []
    for path in sorted(out.glob("eval-*/results.json")):
        report = json.loads(path.read_text())
        data = path.parent.name.split("-", 1)[1]
        rows += [{"data": data, **r} for r in report["results"]]
        comparisons += [{"data": data, **c} for c in report.get("comparisons", [])]
    result.update(results=rows, comparisons=comparisons)
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    (out / "summary.md").write_text(markdown(result))
    return result


def training_caches(root: Path) -> dict[str, Path]:
    """The training caches under ``root`` by the engine that answered (the provenance's
    ``answers``; none for specft's own): read from the manifests, since locating a
    server-answered cache from its config asks the server, which is down by now."""
    found = {}
    for manifest in sorted(root.glob("*/manifest.json")):
        provenance = json.loads(manifest.read_text())["provenance"]
        found[provenance.get("answers", {}).get("engine", "specft")] = manifest.parent
    return found


def markdown(r: dict) -> str:
    lines = ["| engine | slots | conversations | new tokens | regeneration, s | tokens/s | `specft cache` wall, s |",
             "|---|---|---|---|---|---|---|"]
    for s in r["speed"]:
        wall = f"{s['command_wall_s']:.0f}" if s["command_wall_s"] else ""
        lines.append(f"| {s['engine']} | {s['slots'] or ''} | {s['conversations']} | {s['new_tokens']:,} | "
                     f"{s['regeneration_s']:.0f} | {s['tokens_per_s']:.1f} | {wall} |")
    lines += ["", "| answers | compared | identical | median first difference (quartiles), tokens "
                  "|", "|---|---|---|---|"]
    for pair, d in r["divergence"].items():
        quart = d["first_difference_quartiles"]
        spread = f"{d['median_first_difference']} ({quart[0]}-{quart[1]})" if quart else "-"
        lines.append(f"| {pair} | {d['answers']} | {d['identical']} ({100 * d['identical_share']:.0f}%) | {spread} |")
    lines += ["", "| set | k | draft | acceptance [95% CI] (length) | server − specft, pts [paired CI] |",
              "|---|---|---|---|---|"]
    for row in sorted(r["results"], key=lambda x: (x["data"], x["k"], x["draft"])):
        if not row["k"]:
            continue
        diff = ""
        if row["draft"] == "answers_server":
            c = next((c for c in r["comparisons"] if c["data"] == row["data"] and c["k"] == row["k"]), None)
            if c:
                sign = 1 if c["b"] == "answers_server" else -1
                lo, hi = sorted(sign * 100 * v for v in c["rate_difference_ci"])
                diff = f"{sign * 100 * c['rate_difference']:+.1f} [{lo:+.1f}, {hi:+.1f}]"
        lines.append(f"| {row['data']} | {row['k']} | {row['draft']} | {rate_cell(row)} | {diff} |")
    lines += ["", "| step | wall, s |", "|---|---|"] + [f"| {k} | {v:.0f} |" for k, v in r["walls_s"].items()]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, required=True, help="the target as llama.cpp serves it")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--parts", default="speed,train:specft,train:server,eval",
                   help="speed, train:specft, train:server, eval (eval:gsm8k, eval:mtbench), comma-separated")
    p.add_argument("--lanes", default=None, help="';'-separated groups of parts run side by side")
    p.add_argument("--slots", type=int, default=16, help="llama-server's parallel slots (and requests in flight)")
    p.add_argument("--speed-gsm8k", type=int, default=96)
    p.add_argument("--speed-sharegpt", type=int, default=32)
    p.add_argument("--gsm8k-samples", type=int, default=520)
    p.add_argument("--sharegpt-samples", type=int, default=160)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=480)
    p.add_argument("--eval-prompts", type=int, default=128, help="held-out GSM8K prompts")
    p.add_argument("--mtbench-prompts", type=int, default=80, help="MT-Bench questions (80: all)")
    p.add_argument("--k", default="3,4,5", help="draft lengths evaluated (each is one decode of every prompt)")
    p.add_argument("--seed", type=int, default=0)
    add_data_options(p)
    return p


def main() -> None:
    a = parser().parse_args()
    a.out_dir = a.out_dir.resolve()
    if a.lanes:
        run_lanes(Path(__file__).resolve(), sys.argv[1:], a.lanes, a.out_dir)
    else:
        for part in a.parts.split(","):
            if part == "speed":
                speed(a, Steps(a.out_dir, "walls-speed.json"))
            elif part.startswith("train:") and part[len("train:"):] in ENGINES:
                train(a, part[len("train:"):])
            elif part == "eval" or part.startswith("eval:") and part[len("eval:"):] in EVAL_SETS:
                evaluate(a, EVAL_SETS if part == "eval" else (part[len("eval:"):],))
            else:
                raise SystemExit(f"--parts: unknown part {part!r}; known: speed, train:specft, train:server, eval, "
                                 "eval:gsm8k, eval:mtbench")
    print(markdown(summarize(a)))


if __name__ == "__main__":
    main()
