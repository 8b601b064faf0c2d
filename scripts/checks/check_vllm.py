"""Does a real serving engine run specft's drafts the way `specft eval` measures them?

For a trained draft and its target: export the draft (EAGLE-3 layout, float32), decode
the same prompts greedily with specft's engine (the code `specft eval` runs, batch 1) and
with vLLM (its own virtual environment, driven by scripts/checks/vllm_worker.py), target alone
and at each k, and print side by side: rounds, proposed / accepted, acceptance per
position, acceptance length, whether each engine's speculative output equals its own
target-alone output, where the two engines' target-alone outputs first differ, and
throughput. Writes JSON (and the table) under --out.

    python scripts/checks/check_vllm.py RUN_DIR --vllm-python ~/vllm-venv/bin/python --ks 3 5
    python scripts/checks/check_vllm.py RUN_DIR --target-weights mxfp4   # W4A16: MXFP4-dequantized weights
    python scripts/checks/check_vllm.py RUN_DIR --layout speculators --auto-detect   # LLM(model=EXPORT)

`--dequantize CKPT` serves a quantized checkpoint's weights, dequantized as its format
defines them, as an ordinary checkpoint (activations 16-bit) in both engines: for a
rotated target whose format vLLM's CPU path cannot run (msModelSlim's offline QuaRot),
its rotation is folded into those weights, so a draft sees what it would when served.

`--target-weights mxfp4` saves the target with specft's MXFP4 fake-quantized weights as
an ordinary checkpoint, which both engines load: vLLM's CPU path cannot emulate FP8
activations, so W-MXFP4/A16 is the quantized target both can run. vLLM needs the
target's head_dim in its CPU attention's list (32, 64, 80, ...; the tests' tiny models
use 16: build one with model.head_dim=32).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf

from specft.eval.runner import divergence

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "scripts" / "checks" / "vllm_worker.py"


def run_config(run_dir: Path, overrides: list[str]):
    """The run's resolved config with ``overrides`` (dotlist) on top. A config-group choice
    (``data=gsm8k``) has no meaning over a resolved config and would be dropped without a
    word: it is refused."""
    from specft.commands.validate import to_schema

    groups = [o for o in overrides if "." not in o.split("=", 1)[0]]
    if groups:
        raise SystemExit(f"error: override {groups[0]!r} picks a config group; over the run's resolved config give "
                         "its fields (data.name=gsm8k \"data.mix=[]\" data.path=...)")

    base = OmegaConf.create(yaml.safe_load((run_dir / "config.yaml").read_text()))
    return to_schema(OmegaConf.merge(base, OmegaConf.from_dotlist(overrides)))


def save_mxfp4_weights(cfg, out: Path) -> Path:
    """The target with MXFP4 weights (specft's fake quantization), activations 16-bit,
    saved as a plain checkpoint (once)."""
    from specft.quant import apply_quant
    from specft.quant.config import QuantConfig, load_quant_config
    from specft.target_model import load_target

    if (out / "config.json").exists():
        return out
    mx = load_quant_config("mxfp4")
    model, tokenizer = load_target(cfg.model, dtype=torch.float32)
    report = apply_quant(model, QuantConfig(name="mxfp4_w4a16", weight=mx.weight, activation=None, exclude=mx.exclude))
    print(f"w4a16 target: {report.summary()}", flush=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_dequantized(checkpoint: Path, out: Path) -> Path:
    """A quantized checkpoint's weights as its format defines them (specft's
    quant=checkpoint loader, exact), activations 16-bit, saved as a plain checkpoint (once):
    the weight-only twin of a target vLLM's CPU path cannot serve as it is (msModelSlim's
    ascendV1, a rotated one)."""
    from check_checkpoints import specft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").exists():
        return out
    model, tokenizer = specft_model(checkpoint)
    config = AutoConfig.from_pretrained(checkpoint)
    for key in ("quantization_config", "compression_config"):
        if hasattr(config, key):
            delattr(config, key)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v for k, v in model.state_dict().items() if k in plain.state_dict()}
    plain.load_state_dict(state, strict=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"dequantized target: {checkpoint} -> {out}", flush=True)
    return out


def specft_side(cfg, target_dir: Path, checkpoint: Path, ks: list[int], batch: int,
                draft_quant: str, dtype: torch.dtype = torch.float32,
                run_target: bool = True) -> tuple[list, list[dict]]:
    """(prompts, runs): specft's engine on the target at ``target_dir``, target alone then each
    k, ``batch`` prompts at a time (after one untimed warm-up round). A quantized export is
    matched by fake-quantizing the draft the same way (weights and activations).
    ``run_target``: the target is the run's own, so a quantized checkpoint's run-time input
    quantization applies; a dequantized or re-saved one serves 16-bit activations."""
    from specft.config import aux_layer_ids
    from specft.decoding import SamplingConfig, SpecDecoder
    from specft.drafts import DRAFT_ARCHS
    from specft.eval.drafts import load_draft, share_target_embedding
    from specft.eval.prompts import load_prompts
    from specft.target_model import load_target
    from specft.target_model.loader import stop_token_ids

    model_cfg = replace(cfg.model, source="hf", path=str(target_dir), gguf_file=None)
    target, tokenizer = load_target(model_cfg, dtype=dtype)
    if run_target and cfg.quant.from_checkpoint:  # a quantized checkpoint: its run-time input quantization too
        from specft.quant import apply_quant

        apply_quant(target, cfg.quant)
    prompts, _ = load_prompts(cfg, tokenizer)
    eos, pad = stop_token_ids(tokenizer, target), tokenizer.pad_token_id or 0
    draft, meta = load_draft(checkpoint, dtype)
    if draft_quant not in ("none", "auto") and meta.get("draft_quant") != draft_quant:
        from specft.drafts.qat import apply_draft_qat
        from specft.quant.config import load_quant_config

        apply_draft_qat(draft, load_quant_config(draft_quant))
    share_target_embedding(draft, target)
    runs = []
    for k in [0, *ks]:
        runner = DRAFT_ARCHS.get(draft.architecture).runner(draft) if k else None
        decoder = SpecDecoder(target, runner, aux_layer_ids(cfg.model), eos, pad)
        decoder.generate(prompts[:1], k, 4, SamplingConfig(0.0))  # warm-up: first calls allocate
        tokens, start = [], time.perf_counter()
        totals = {"rounds": 0, "proposed": 0, "accepted": 0, "per_position": [0] * k}
        for i in range(0, len(prompts), batch):
            res = decoder.generate(prompts[i: i + batch], k, cfg.eval.max_new_tokens, SamplingConfig(0.0), seed=i)
            tokens.extend(res.tokens)
            st = res.stats
            totals["rounds"] += st.rounds
            totals["proposed"] += st.proposed
            totals["accepted"] += st.accepted
            totals["per_position"] = [a + b for a, b in zip(totals["per_position"], st.accepted_at)]
        runs.append({"k": k, "tokens": tokens, "seconds": time.perf_counter() - start,
                     "generated": sum(map(len, tokens)), **(totals if k else {})})
        print(f"specft k={k}: {runs[-1]['generated']} tokens in {runs[-1]['seconds']:.1f} s", flush=True)
    return prompts, runs


def vllm_side(vllm_python: str, request: dict, work: Path, name: str = "vllm") -> dict:
    req, res, log = (work / f"{name}_{what}" for what in ("request.json", "result.json", "log.txt"))
    req.write_text(json.dumps(request))
    env = {**os.environ, "PYTHONPATH": ""}  # nothing of this environment leaks into vLLM's
    with open(log, "w") as f:
        proc = subprocess.run([vllm_python, str(WORKER), str(req), str(res)], stdout=f, stderr=subprocess.STDOUT,
                              env=env, cwd=work)
    if proc.returncode:
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"vLLM failed (exit {proc.returncode}); last lines of {log}:\n" + "\n".join(tail))
    return json.loads(res.read_text())


def summarize(run: dict, alone: dict) -> dict:
    rounds = run.get("rounds", run.get("num_drafts", 0))
    proposed = run.get("proposed", run.get("num_draft_tokens", 0))
    accepted = run.get("accepted", run.get("num_accepted_tokens", 0))
    return {"k": run["k"], "rounds": rounds, "proposed": proposed, "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "acceptance_length": (accepted + rounds) / rounds if rounds else 0.0,
            "per_position": run.get("per_position", []),
            "equals_target_alone": divergence(run["tokens"], alone["tokens"])["rows_diverged"] == 0,
            "generated": run["generated"], "tokens_per_s": run["generated"] / run["seconds"]}


def table(rows: list[dict]) -> str:
    head = ("| engine | k | rounds | proposed | accepted | rate | per position | acc. length | "
            "= target alone | tok/s |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['k']} | {r['rounds']} | {r['proposed']} | {r['accepted']} | "
                     f"{r['acceptance_rate']:.3f} | {'/'.join(map(str, r['per_position']))} | "
                     f"{r['acceptance_length']:.3f} | {'yes' if r['equals_target_alone'] else 'no'} | "
                     f"{r['tokens_per_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    import specft.drafts  # noqa: F401  (registers every architecture's layouts)
    from specft.drafts.layouts import LAYOUTS
    from specft.eval.drafts import resolve_checkpoint
    from specft.export import export_draft

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a specft run dir (its config.yaml and final checkpoint)")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "vllm-venv/bin/python"))
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together, in both engines")
    ap.add_argument("--target-weights", choices=["as-is", "mxfp4"], default="as-is")
    ap.add_argument("--dequantize", type=Path, default=None,
                    help="serve this quantized checkpoint's dequantized weights (16-bit activations) as the "
                         "target, in both engines, e.g. a rotated msModelSlim checkpoint vLLM's CPU path cannot run")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="both engines' compute dtype (vLLM's CPU INT8 kernels take bfloat16 inputs only)")
    ap.add_argument("--layout", choices=["eagle3", "speculators", "peagle", "dflash"], default="eagle3",
                    help="peagle: a P-EAGLE draft, served with vLLM's parallel drafting; dflash: a DFlash draft")
    ap.add_argument("--quant", choices=["none", "auto", "fp8", "mxfp4"], default="none",
                    help="the export's weights (compressed-tensors for fp8 / mxfp4), as `specft export --quant`")
    ap.add_argument("--auto-detect", action="store_true",
                    help="also load the speculators export alone (LLM(model=EXPORT)) at its own k")
    ap.add_argument("--out", type=Path, default=None, help="default: RUN/check_vllm-<target-weights>")
    ap.add_argument("overrides", nargs="*", help="fields of the run's config for the prompts, e.g. data.name=gsm8k "
                                                 "data.path=... (a run trained on a mix: also 'data.mix=[]')")
    args = ap.parse_intermixed_args()

    run_dir = args.run.resolve()
    out = (args.out or run_dir / f"check_vllm-{args.target_weights}-{args.layout}-{args.quant}").resolve()
    cfg = run_config(run_dir, [f"eval.num_prompts={args.num_prompts}", f"eval.max_new_tokens={args.max_new_tokens}",
                               *args.overrides])
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = resolve_checkpoint(run_dir, "run")
    export = export_draft(checkpoint, out / f"export-{args.layout}-{args.quant}", layout=args.layout,
                          quant=args.quant, dtype=args.dtype, overwrite=True)
    exported = json.loads((export / "config.json").read_text())
    verifier = exported["specft"]["target_path"]
    target_dir = Path(verifier)
    if args.target_weights == "mxfp4" or args.dequantize:
        target_dir = save_dequantized(args.dequantize.resolve(), out / "target-dequantized") if args.dequantize \
            else save_mxfp4_weights(cfg, out / "target-w4a16")
        if args.layout == "speculators":  # the export must name the target vLLM is to load
            exported["speculators_config"]["verifier"]["name_or_path"] = str(target_dir)
            (export / "config.json").write_text(json.dumps(exported, indent=2))

    prompts, specft_runs = specft_side(cfg, target_dir, checkpoint, args.ks, args.batch, args.quant,
                                       getattr(torch, args.dtype),
                                       run_target=not args.dequantize and args.target_weights == "as-is")
    request = {"target": str(target_dir), "draft": str(export), "prompts": prompts, "ks": args.ks,
               "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "target_alone": True,
               "max_num_seqs": args.batch, "speculative": LAYOUTS.get(args.layout).vllm_speculative}
    work = out / "vllm"
    work.mkdir(exist_ok=True)
    vllm = vllm_side(args.vllm_python, request, work)
    if args.auto_detect:
        k_own = exported["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        auto = vllm_side(args.vllm_python, {**request, "ks": [k_own], "target_alone": False,
                                            "auto_detect": True}, work, "auto")
        vllm["runs"] += [{**r, "auto_detect": True} for r in auto["runs"]]

    rows = []
    for engine, runs in (("specft", specft_runs), ("vLLM", vllm["runs"])):
        alone = runs[0]
        for r in runs:
            name = engine + (" (auto-detect)" if r.get("auto_detect") else "")
            rows.append({"engine": name, **summarize(r, alone)})
    between = divergence(specft_runs[0]["tokens"], vllm["runs"][0]["tokens"])
    result = {"run": str(run_dir), "target": str(target_dir), "target_weights": args.target_weights,
              "dequantized": str(args.dequantize) if args.dequantize else None,
              "layout": args.layout, "dtype": args.dtype, "draft_export_quant": args.quant, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens,
              "batch": args.batch,
              "vllm_version": vllm["vllm_version"], "torch_threads": torch.get_num_threads(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "target_alone_divergence": between, "rows": rows}
    md = (f"{table(rows)}\n\nTarget alone, specft vs vLLM: {between['rows_diverged']} of {between['rows']} "
          f"outputs differ; first differing token at {100 * between['flip_rate']:.2f}% of compared tokens.\n")
    (out / "check_vllm.json").write_text(json.dumps(result, indent=2))
    (out / "check_vllm.md").write_text(md)
    print(md)
    print(f"wrote {out / 'check_vllm.json'}")


if __name__ == "__main__":
    sys.exit(main())
