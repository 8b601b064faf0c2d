"""Peak memory of a quantized checkpoint target, packed against dense
(model.checkpoint_weights), with the forward's speed, side by side on one machine.

Each (checkpoint, mode) runs in a fresh process, one after the other: it loads the target
as stage 1 does (model=hf model.path=DIR quant=checkpoint), then runs --forwards forward
passes over a batch of --tokens random tokens. It reports the process's peak RSS after the
load and after the forwards (ru_maxrss, so the load's transient peak counts), the bytes
the model's tensors hold, the load time and the forward's median time; the last forward's
logits are compared between modes (they must be equal, bit for bit).

    python scripts/bench_checkpoint_memory.py /work/ckpts/smollm2_gptq_g64_actorder \\
        --out docs/results/checkpoints/memory
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

MODES = ("dense", "packed")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(model_dir: Path, mode: str, tokens: int, forwards: int, dtype: str, logits_out: Path) -> dict:
    """One process's figures (run with --child)."""
    from check_checkpoints import specft_model

    ids = torch.randint(0, 2**31 - 1, (1, tokens), generator=torch.Generator().manual_seed(0))
    base_mb = _peak_mb()
    t0 = time.perf_counter()
    model, _ = specft_model(model_dir, "checkpoint", f"model.dtype={dtype}", f"model.checkpoint_weights={mode}",
                            "eval.dtype=float32")
    load_s = time.perf_counter() - t0
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    load_mb = _peak_mb()
    ids = ids % model.config.vocab_size  # drawn before the load: a dense load's init draws from torch's RNG
    times = []
    with torch.no_grad():
        for _ in range(forwards):
            t0 = time.perf_counter()
            logits = model(ids).logits
            times.append(time.perf_counter() - t0)
    torch.save(logits, logits_out)
    return {"checkpoint": model_dir.name, "mode": mode, "dtype": dtype, "tensors_mb": held / 2**20,
            "peak_rss_mb_before_load": base_mb, "peak_rss_mb_after_load": load_mb, "peak_rss_mb": _peak_mb(),
            "load_s": load_s, "forward_s_median": statistics.median(times), "forwards": forwards, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", type=Path)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--forwards", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "LOGITS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, logits = args.child
        print(json.dumps(measure(args.checkpoints[0], mode, args.tokens, args.forwards, args.dtype, Path(logits))))
        return
    rows, scratch = [], Path(args.out or ".") / ".logits"
    scratch.mkdir(parents=True, exist_ok=True)
    for ckpt in args.checkpoints:
        for mode in MODES:
            cmd = [sys.executable, __file__, str(ckpt), "--tokens", str(args.tokens), "--forwards", str(args.forwards),
                   "--dtype", args.dtype, "--child", mode, str(scratch / f"{ckpt.name}-{mode}.pt")]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
        a, b = (torch.load(scratch / f"{ckpt.name}-{m}.pt") for m in MODES)
        rows[-1]["logits_equal_to_dense"] = bool(torch.equal(a, b))
    lines = ["| checkpoint | mode | tensors MB | peak RSS after load MB | peak RSS MB | load s | forward s (median) "
             "| logits = dense |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['checkpoint']} | {r['mode']} | {r['tensors_mb']:.0f} | {r['peak_rss_mb_after_load']:.0f} | "
                     f"{r['peak_rss_mb']:.0f} | {r['load_s']:.1f} | {r['forward_s_median']:.3f} | "
                     f"{r.get('logits_equal_to_dense', '-')} |")
    machine = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "dtype": args.dtype, "tokens": args.tokens}
    table = "\n".join(lines)
    print(table)
    print(machine)
    if args.out:
        (args.out / "memory.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
        (args.out / "memory.md").write_text(f"{table}\n\n{machine}\n")
    for f in scratch.iterdir():
        f.unlink()
    scratch.rmdir()


if __name__ == "__main__":
    main()
