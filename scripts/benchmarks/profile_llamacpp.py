"""Where llama-server's CPU time goes, by kernel: the target alone and with each draft, from
`perf record` on the server (one thread), grouped by the weight type each kernel reads.

round_cost.py splits a round from outside (llama-bench's V(N), the rest called the draft's
share D); this looks inside the same server the bench times. A kernel's name carries the
weight type it multiplies (ggml's repacked `block_mxfp4x8`, tinyBLAS's `block_q8_0`,
`block<4, 8>` for Q4_0), so on a target whose layers are one type and whose output head is
another (SmolLM2's MXFP4 GGUF: MXFP4 layers, a Q8_0 tied embedding and head) and a draft of a
third (Q4_0), each group is one part of the round: the target's layers, the target's head
over every verified row, the draft's weights. The groups are --groups NAME=REGEX (first
match wins; the rest is "other ops"). Every configuration decodes the same prompts; the
server's CPU time per generated token (psutil) times each group's share of perf's samples
is that part's CPU milliseconds per token. Prints a table and writes profile_llamacpp.json.

    python scripts/benchmarks/profile_llamacpp.py --target mxfp4=MXFP4.gguf --drafts specft=DRAFT.gguf \
        --prompts-run RUN --num-prompts 8 data.split=validation data.val_fraction=0.1 trainer.val_data=split
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checks"))  # check_vllm

# SmolLM2's MXFP4 GGUF with a Q4_0 draft: which kernels read which weights
# (ggml's Q4_0 x Q8_0 kernels name Q8_0 too: the draft's group comes before the head's)
DEFAULT_GROUPS = ["target layers (MXFP4)=mxfp4", "draft weights (Q4_0)=block<4, 8>|block_q4_0|q4_0_q8_0",
                  "target head (Q8_0)=block_q8_0, block_q8_0|vec_dot_q8_0_q8_0",
                  "attention=flash_attn|vec_dot_f16|expf"]
SAMPLE = re.compile(r"^\s*([0-9.]+)%\s+(\S+)\s+\[[.k]\]\s+(.+?)\s*$")


def perf_symbols(data: Path) -> list[tuple[float, str]]:
    """(share of samples in %, symbol) of every symbol perf recorded."""
    report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,symbol", "--stdio"],
                            capture_output=True, text=True, check=True).stdout
    return [(float(m.group(1)), m.group(3)) for m in map(SAMPLE.match, report.splitlines()) if m]


def grouped(symbols: list[tuple[float, str]], groups: list[tuple[str, re.Pattern]]) -> dict[str, float]:
    shares = {name: 0.0 for name, _ in groups} | {"other ops": 0.0}
    for share, symbol in symbols:
        name = next((n for n, pattern in groups if pattern.search(symbol)), "other ops")
        shares[name] += share
    total = sum(shares.values()) or 1.0
    return {name: share / total for name, share in shares.items()}


def profile(target: Path, draft: Path | None, k: int, prompts: list[list[int]], max_new_tokens: int,
            extra: list[str], data: Path) -> dict:
    from bench_llamacpp import cpu_seconds, tight_context

    from specft.llamacpp.server import LlamaServer, ServerOptions

    options = ServerOptions(target, draft, draft_n=k, threads=1,
                            ctx_per_slot=tight_context(prompts, max_new_tokens), extra=extra)
    with LlamaServer(options) as server:
        server.complete(prompts[0], 8)  # warm-up
        pid = server.process.pid
        perf = subprocess.Popen(["perf", "record", "-F", "999", "-p", str(pid), "-o", str(data)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf attached before the first request
        cpu_start = cpu_seconds(pid)
        outs = [server.complete(ids, max_new_tokens) for ids in prompts]
        cpu = cpu_seconds(pid) - cpu_start
        perf.send_signal(signal.SIGINT)
        perf.wait()
    tokens = sum(len(o["tokens"]) for o in outs)
    drafted = sum(o["timings"].get("draft_n", 0) for o in outs)
    accepted = sum(o["timings"].get("draft_n_accepted", 0) for o in outs)
    return {"tokens": tokens, "cpu_seconds": cpu, "cpu_ms_per_token": 1000 * cpu / tokens,
            "drafted": drafted, "accepted": accepted, "symbols": perf_symbols(data)[:40],
            "per_prompt_tokens": [len(o["tokens"]) for o in outs],
            "per_prompt_drafted_accepted": [[o["timings"].get("draft_n", 0), o["timings"].get("draft_n_accepted", 0)]
                                            for o in outs]}


def table(rows: list[dict], names: list[str]) -> str:
    head = "| configuration | CPU ms per token | " + " | ".join(names) + " | accepted / drafted |"
    lines = [head, "|" + "---|" * (len(names) + 3)]
    for r in rows:
        cells = [f"{r['cpu_ms_per_token'] * r['shares'][n]:.2f} ({100 * r['shares'][n]:.0f}%)" for n in names]
        lines.append(f"| {r['config']} | {r['cpu_ms_per_token']:.2f} | " + " | ".join(cells)
                     + f" | {r['accepted']}/{r['drafted']} |")
    return "\n".join(lines)


def main() -> None:
    from bench_llamacpp import batch_flags, load_prompts, machine

    from specft.llamacpp.install import install_record

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="NAME=FILE.gguf")
    ap.add_argument("--drafts", nargs="*", default=[], help="NAME=DRAFT.gguf (the target alone is always profiled)")
    ap.add_argument("--prompts-run", type=Path, required=True, help="a run whose eval prompts are decoded")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--ubatch", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--groups", nargs="+", default=DEFAULT_GROUPS, help="NAME=REGEX over kernel names, in order")
    ap.add_argument("--out", type=Path, default=Path("runs/profile_llamacpp"))
    ap.add_argument("overrides", nargs="*", help="fields of the prompts run's config, e.g. data.split=validation")
    args = ap.parse_intermixed_args()
    if shutil.which("perf") is None:
        raise SystemExit("profile_llamacpp: perf is missing (apt-get install linux-perf)")
    groups = [(name, re.compile(pattern)) for name, _, pattern in (g.partition("=") for g in args.groups)]
    tname, _, tpath = args.target.partition("=")
    configs = [("alone", None)] + [(n, Path(p)) for n, _, p in (d.partition("=") for d in args.drafts)]
    prompts = load_prompts(args.prompts_run, args.num_prompts, args.overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, draft in configs:
        r = profile(Path(tpath), draft, args.k, prompts, args.max_new_tokens, batch_flags(args) or [],
                    args.out / f"perf-{name}.data")
        r.update(config=name, shares=grouped(r["symbols"], groups))
        rows.append(r)
        print(f"{name}: {r['cpu_ms_per_token']:.2f} CPU ms per token, accepted {r['accepted']}/{r['drafted']}",
              flush=True)
    names = [n for n, _ in groups] + ["other ops"]
    md = table(rows, names)
    result = {"machine": machine(), "llamacpp": install_record(), "target": tname, "k": args.k,
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "ubatch": args.ubatch,
              "batch": args.batch, "groups": args.groups, "rows": rows, "table": md}
    (args.out / "profile_llamacpp.json").write_text(json.dumps(result, indent=1))
    (args.out / "profile_llamacpp.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
