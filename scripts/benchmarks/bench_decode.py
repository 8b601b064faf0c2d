"""The quantized target's batched decode step, against this machine's own limits.

One run, side by side on one machine, for SmolLM2-135M-Instruct per quant (bf16 = no
quantization, fp8, mxfp4) and batch size:

  (a) roofline: the model's GEMMs (30 layers + head) at this batch, fp32 and bf16, and a
      weight-sized memory read (the bound when a step is bandwidth-bound)
  (b) forward: the bare batched forward, one token per row, with transformers' KV cache
  (c) regenerate: ``specft.engines.generate.generate_batch`` (what stage 1 runs)
  (d) eval: ``specft eval``'s target-alone decoding (SpecDecoder, k=0)
  (e) spec: speculative rounds at k=3 with an EAGLE-3 draft (random weights: the cost of a
      round, not its acceptance), and the round's parts timed apart (draft propose + extend,
      one (k+1)-token target forward)

each as tokens/s and as a share of (a)'s fp32 roofline, plus a per-phase profile of (c)
and (d) saying where the time goes. The rows go to a table on stdout and to JSON.

  python scripts/benchmarks/bench_decode.py                        # the full grid
  python scripts/benchmarks/bench_decode.py --quants mxfp4 --batches 16 --label after

Run it on the old and new code (e.g. a git worktree of the old commit) with the same
arguments and compare the JSON files with --compare OLD.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
import zlib
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


# -- machine ---------------------------------------------------------------------------

def machine() -> dict:
    flags = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni") if f in flags]
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "?") \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"cpu": model, "cores": os.cpu_count(), "isa": isa, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "mkldnn_bf16": torch.backends.mkldnn.is_available()}


# -- prompts ---------------------------------------------------------------------------

def build_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n chat prompts of ~``length`` tokens: GSM8K questions (../shared/data) in one user
    turn until the prompt is long enough; synthetic arithmetic where GSM8K is absent."""
    from specft.data.template import prompt_ids

    if GSM8K.exists():
        questions = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[: 40 * n]]
    else:
        from specft.target_model.word_problems import synthetic_conversations

        questions = [c[0]["content"] for c in synthetic_conversations(40 * n, seed=0)]
    prompts, q = [], iter(questions)
    for _ in range(n):
        text = ""
        while True:
            text += next(q) + "\n"
            ids = prompt_ids(tokenizer, [{"role": "user", "content": text + "Answer the last question."}])
            if len(ids) >= length:
                break
        prompts.append(ids)
    return prompts


# -- models ----------------------------------------------------------------------------

def _configs(quant: str):
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from helpers import model_cfg, quant_cfg

    return model_cfg("smollm2_135m"), quant_cfg(quant)


def quantized_target(quant: str, calib: list[list[int]], dtype: str = "float32"):
    from specft.quant import apply_quant, calibrate
    from specft.target_model import load_target

    mcfg, qcfg = _configs(quant)
    mcfg.dtype = dtype
    model, tokenizer = load_target(mcfg)
    report = apply_quant(model, qcfg)
    if qcfg.needs_calibration:
        calibrate(model, report, ({"input_ids": torch.tensor([p])} for p in calib))
    return model.to(getattr(torch, dtype)).eval(), tokenizer, mcfg


def random_draft(mcfg, model, vocab: int = 32000):
    from specft.drafts import DraftHeadConfig, Eagle3Draft

    torch.manual_seed(0)
    c = DraftHeadConfig(hidden_size=mcfg.hidden_size, num_heads=mcfg.num_heads, num_kv_heads=mcfg.num_kv_heads,
                     head_dim=mcfg.head_dim, intermediate_size=mcfg.intermediate_size,
                     target_vocab_size=mcfg.vocab_size, draft_vocab_size=vocab)
    emb = model.get_input_embeddings().weight.detach()
    draft = Eagle3Draft(c, emb, torch.arange(vocab)).eval()
    with torch.no_grad():  # small weights: hidden states stay finite over a long chain
        for p in draft.parameters():
            if p.dim() == 2 and p.requires_grad:
                p.normal_(0, 0.02)
    return draft


# -- (a) roofline ------------------------------------------------------------------------

def gemm_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of every weight matmul one token goes through."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    return layer * cfg.num_layers + [(h, cfg.vocab_size)]


def _times(fn, reps: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _best_of(fn, reps: int) -> float:
    return min(_times(fn, reps))


def _median_of(fn, reps: int) -> float:
    import statistics

    return statistics.median(_times(fn, reps))


def roofline(cfg, batch: int, reps: int = 3) -> dict:
    shapes = gemm_shapes(cfg)
    flops = 2 * sum(a * b for a, b in shapes)
    out = {"flops_per_token": flops}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        weights = [torch.randn(b, a, dtype=dtype) for a, b in shapes]  # distinct: no cache reuse
        x = {a: torch.randn(batch, a, dtype=dtype) for a, _ in shapes}

        def step(weights=weights, x=x):
            for w in weights:
                torch.nn.functional.linear(x[w.shape[1]], w)

        t = _best_of(step, reps)
        out[f"gemm_{name}_tok_s"] = batch / t
        out[f"gemm_{name}_gflops"] = flops * batch / t / 1e9
        del weights
    weight_bytes = 4 * sum(a * b for a, b in shapes)
    buf = torch.empty(weight_bytes // 4, dtype=torch.float32).normal_()
    t = _best_of(lambda: buf.sum(), reps)
    out["read_fp32_weights_s"] = t
    out["read_bound_tok_s"] = batch / t
    out["read_gb_s"] = weight_bytes / t / 1e9
    return out


# -- a profile of where a decode step's time goes ------------------------------------------

class PhaseTimer:
    """Wall time per phase, from wrappers around the functions each phase runs. The
    phases are disjoint (none calls another), so 'other' = total - the sum of them."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)
        self._undo = []

    def wrap(self, owner, attr: str, phase):
        original = getattr(owner, attr)
        timer = self

        def wrapped(*args, **kwargs):
            name = phase(args) if callable(phase) else phase
            if name is None:
                return original(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timer.seconds[name] += time.perf_counter() - t0
                timer.calls[name] += 1

        setattr(owner, attr, wrapped)
        self._undo.append((owner, attr, original))


def instrument(model) -> PhaseTimer:
    import transformers.models.llama.modeling_llama as llama
    from transformers import cache_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import specft.decoding.engine as engine
    import specft.decoding.sampling as sampling
    import specft.quant.apply as qapply

    timer = PhaseTimer()
    names = {id(m): n for n, m in model.named_modules()}

    def linear_phase(args):
        n = names.get(id(args[0]), "")
        return "lm_head matmul" if n.endswith("lm_head") else "MLP matmuls" if ".mlp." in n else \
            "attention projections" if ".self_attn." in n else None

    timer.wrap(torch.nn.Linear, "forward", linear_phase)
    timer.wrap(qapply.ActivationQuantizer, "__call__", "activation fake-quant")
    impl = model.config._attn_implementation
    if impl in ALL_ATTENTION_FUNCTIONS:
        original = ALL_ATTENTION_FUNCTIONS[impl]
        t = timer

        def attention(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                t.seconds["attention (sdpa)"] += time.perf_counter() - t0
                t.calls["attention (sdpa)"] += 1

        ALL_ATTENTION_FUNCTIONS._global_mapping[impl] = attention
        timer._undo.append((None, impl, original))
    layers = [cache_utils.DynamicLayer]
    with contextlib.suppress(ImportError):  # specft's in-place cache, where this code has it
        from specft.decoding.kv_cache import InPlaceLayer

        layers.append(InPlaceLayer)
    for cls in layers:
        for attr in ("update", "crop", "batch_select_indices"):
            if attr in vars(cls):
                timer.wrap(cls, attr, "KV-cache handling")
    timer.wrap(llama, "create_causal_mask", "mask building")
    for mod in (engine, sampling):
        for attr in ("verify_greedy", "sample", "warp"):
            if hasattr(mod, attr):
                timer.wrap(mod, attr, "sampling / verification")
    return timer


def restore(timer: PhaseTimer) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for owner, attr, original in reversed(timer._undo):
        if owner is None:
            ALL_ATTENTION_FUNCTIONS._global_mapping[attr] = original
        else:
            setattr(owner, attr, original)
    timer._undo.clear()


def profile_rows(timer: PhaseTimer, total_s: float) -> list[dict]:
    rows = [{"phase": k, "seconds": v, "share": v / total_s, "calls": timer.calls[k]}
            for k, v in sorted(timer.seconds.items(), key=lambda kv: -kv[1])]
    other = total_s - sum(timer.seconds.values())
    rows.append({"phase": "other (norms, RoPE, residuals, Python)", "seconds": other,
                 "share": other / total_s, "calls": 0})
    return rows


# -- (b)-(e) ---------------------------------------------------------------------------

@torch.no_grad()
def bare_forward(model, prompts, new_tokens: int) -> dict:
    from transformers import DynamicCache

    from specft.target_model.loader import left_pad

    ids, valid = left_pad(prompts, 0)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=valid, cache=cache, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    mask = valid
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        mask = torch.cat([mask, torch.ones_like(tok)], 1)
        out = model(input_ids=tok, attention_mask=mask, cache=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    t = time.perf_counter() - t0
    return {"tokens": new_tokens * len(prompts), "seconds": t}


@contextlib.contextmanager
def prefill_clock(model):
    """Times the model's multi-token forwards (the prefill, in a target-alone decode)."""
    spent = {"prefill_s": 0.0}
    original = model.forward

    def forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.shape[-1] == 1:
            return original(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent["prefill_s"] += time.perf_counter() - t0

    model.forward = forward
    try:
        yield spent
    finally:
        del model.forward  # back to the class's method


def regenerate_path(model, tokenizer, prompts, new_tokens: int) -> dict:
    from specft.config import RegenerateConfig
    from specft.engines.generate import generate_batch

    with prefill_clock(model) as spent:
        t0 = time.perf_counter()
        answers, _ = generate_batch(model, tokenizer, prompts, RegenerateConfig(max_new_tokens=new_tokens), seed=0)
        t = time.perf_counter() - t0
    steps = max(len(a) for a in answers) + 1
    return {"tokens": sum(len(a) for a in answers), "seconds": t, "answers": answers,
            "prefill_s": spent["prefill_s"], "decode_s": t - spent["prefill_s"],
            "padding_share": 1 - sum(len(a) + 1 for a in answers) / (steps * len(answers))}


def eval_path(model, tokenizer, prompts, new_tokens: int, draft=None, k: int = 0) -> dict:
    from specft.decoding import SpecDecoder
    from specft.decoding.draft import ChainRunner
    from specft.target_model.loader import stop_token_ids

    runner = ChainRunner(draft) if draft is not None else None
    decoder = SpecDecoder(model, runner, [1, 14, 26] if draft is not None else None,
                          stop_token_ids(tokenizer, model), tokenizer.pad_token_id or 0)
    res = decoder.generate(prompts, k, new_tokens)
    st = res.stats
    return {"tokens": st.generated, "seconds": st.prefill_s + st.decode_s, "decode_s": st.decode_s,
            "prefill_s": st.prefill_s, "rounds": st.rounds, "answers": res.tokens,
            "accepted": st.accepted, "proposed": st.proposed}


def timed_rounds(model, tokenizer, prompts, new_tokens: int, draft) -> tuple[dict, float]:
    """Speculative decoding at k=3 with each loop iteration (the round, then emitting its
    tokens) timed; (the eval path's result, the median seconds per iteration)."""
    import statistics

    from specft.decoding.engine import SpecDecoder

    spent = {"_round": [], "_emit": []}
    real = {name: getattr(SpecDecoder, name) for name in spent}

    def timed(name):
        def wrapper(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return real[name](self, *a, **kw)
            finally:
                spent[name].append(time.perf_counter() - t0)
        return wrapper

    for name in spent:
        setattr(SpecDecoder, name, timed(name))
    try:
        res = eval_path(model, tokenizer, prompts, new_tokens, draft, k=3)
    finally:
        for name in spent:
            setattr(SpecDecoder, name, real[name])
    # Medians, like round_parts: noise on a shared machine moves means.
    return res, statistics.median(spent["_round"]) + statistics.median(spent["_emit"])


@torch.no_grad()
def round_parts(model, draft, prompts, k: int, reps: int) -> dict:
    """The parts of one round timed apart: the draft's propose (k steps) + extend (the kept
    positions), and one (k+1)-token target forward."""
    from specft.decoding.draft import ChainRunner
    from specft.decoding.engine import SpecDecoder
    from specft.decoding.sampling import SamplingConfig

    runner = ChainRunner(draft)
    dec = SpecDecoder(model, runner, [1, 14, 26], set(), 0)
    s = SamplingConfig()
    state = dec._prefill(prompts, s, None, torch.device("cpu"))
    b = len(prompts)
    fed = torch.cat([state.last[:, None], torch.zeros(b, k, dtype=torch.long)], 1)

    def verify():
        step = dec.target.forward(fed)
        dec.target.commit(torch.zeros(b, dtype=torch.long) + 1)
        return step

    def drafting():
        prop = runner.propose(state.d_hidden, state.d_logits, k, s)
        return prop

    step = verify()
    keep = torch.zeros(b, k + 1, dtype=torch.bool)
    keep[:, 0] = True

    def extend():
        runner.extend(step.aux, step.final, fed, fed, keep)

    # Medians, as the rounds' own time is a median: noise on a shared machine moves means.
    return {"verify_s": _median_of(verify, reps), "propose_s": _median_of(drafting, reps),
            "extend_s": _median_of(extend, reps)}


# -- the grid ------------------------------------------------------------------------

PATHS = ("forward", "regenerate", "eval", "spec")


def bench_one(quant: str, batch: int, args, prompts_all, profile: bool) -> list[dict]:
    model, tokenizer, mcfg = quantized_target(quant, prompts_all[:4], args.dtype)
    prompts = prompts_all[:batch]
    base = {"quant": quant, "batch": batch, "dtype": args.dtype}
    roof = roofline(mcfg, batch)
    rows = [{**base, "path": "roofline", **roof}]
    print(f"  {quant} b={batch}: roofline fp32 {roof['gemm_fp32_tok_s']:.0f} tok/s", flush=True)

    def add(path, res, **extra):
        tok_s = res["tokens"] / res["seconds"]
        row = {**base, "path": path, "tokens": res["tokens"], "seconds": res["seconds"], "tok_s": tok_s,
               "vs_fp32_roofline": tok_s / roof["gemm_fp32_tok_s"], **extra}
        rows.append(row)
        decode = (f"; decode phase {row['decode_tok_s']:.1f} tok/s ({row['decode_vs_fp32_roofline']:.0%})"
                  if "decode_tok_s" in row else "")
        print(f"  {quant} b={batch} {args.dtype} {path}: {tok_s:.1f} tok/s ({row['vs_fp32_roofline']:.0%} of fp32 "
              "roofline)"
              f"{decode}", flush=True)
        return row

    if "forward" in args.paths:
        add("forward", bare_forward(model, prompts, args.new_tokens))
    for path, fn in (("regenerate", lambda: regenerate_path(model, tokenizer, prompts, args.new_tokens)),
                     ("eval", lambda: eval_path(model, tokenizer, prompts, args.new_tokens))):
        if path not in args.paths:
            continue
        timer = instrument(model) if profile else None
        try:
            res = fn()
        finally:
            if timer is not None:
                restore(timer)
        extra = {"padding_share": res["padding_share"]} if "padding_share" in res else {}
        extra["prefill_s"] = res["prefill_s"]
        extra["decode_tok_s"] = res["tokens"] / res["decode_s"]
        extra["decode_vs_fp32_roofline"] = extra["decode_tok_s"] / roof["gemm_fp32_tok_s"]
        row = add(path, res, **extra)
        # crc32, not hash(): str hashes are salted per process, and the digest is compared
        # across processes (the --against checkout runs in its own).
        row["answers_digest"] = zlib.crc32(str(res["answers"]).encode())
        if timer is not None:
            row["profile"] = profile_rows(timer, res["seconds"])
    if "spec" in args.paths:
        for vocab in (int(v) for v in args.draft_vocab.split(",")):
            draft = random_draft(mcfg, model, vocab).to(model.dtype)
            res, per_round = timed_rounds(model, tokenizer, prompts, args.spec_tokens, draft)
            parts = round_parts(model, draft, prompts, 3, reps=9)
            parts_s = parts["verify_s"] + parts["propose_s"] + parts["extend_s"]
            add("spec k=3" if vocab == 32000 else f"spec k=3 vocab {vocab}", res, round_ms=1000 * per_round,
                parts_ms=1000 * parts_s, engine_overhead=per_round / parts_s - 1,
                **{f"{k}_ms": 1000 * v for k, v in parts.items()}, acceptance=res["accepted"] / max(res["proposed"], 1))
            print(f"    round {1000 * per_round:.1f} ms vs parts {1000 * parts_s:.1f} ms "
                  f"(verify {1000 * parts['verify_s']:.1f}, propose {1000 * parts['propose_s']:.1f}, "
                  f"extend {1000 * parts['extend_s']:.1f})", flush=True)
    return rows


def table(rows: list[dict], old: dict | None) -> str:
    head = ("| quant | batch | path | tok/s | of fp32 roofline | decode phase tok/s (of roofline) |"
            + (" before tok/s | before decode phase | after/before (decode phase) |" if old else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["path"] == "roofline":
            cells = [r["quant"], r["batch"], "roofline GEMM fp32 / bf16 / weight read",
                     f"{r['gemm_fp32_tok_s']:.0f} / {r['gemm_bf16_tok_s']:.0f} / "
                     f"{r['read_bound_tok_s']:.0f}", "1.00", ""]
            if old:
                o = old.get((r["quant"], r["batch"], "roofline"))
                cells += [f"{o['gemm_fp32_tok_s']:.0f} (fp32)" if o else "", "", ""]
        else:
            path = f"{r['path']} ({r.get('dtype', 'float32')})"
            decode = (f"{r['decode_tok_s']:.1f} ({r['decode_vs_fp32_roofline']:.2f})" if "decode_tok_s" in r
                      else f"round {r['round_ms']:.0f} ms vs parts {r['parts_ms']:.0f} ms" if "round_ms" in r else "")
            cells = [r["quant"], r["batch"], path, f"{r['tok_s']:.1f}", f"{r['vs_fp32_roofline']:.2f}", decode]
            if old:
                o = old.get((r["quant"], r["batch"], r["path"]))
                cells += _before_cells(r, o) if o else ["", "", ""]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _before_cells(r: dict, o: dict) -> list[str]:
    if "decode_tok_s" in r:
        return [f"{o['tok_s']:.1f}", f"{o['decode_tok_s']:.1f}", f"{r['tok_s'] / o['tok_s']:.2f}x "
                f"({r['decode_tok_s'] / o['decode_tok_s']:.2f}x)"]
    if "round_ms" in r:
        return [f"{o['tok_s']:.1f}", f"round {o['round_ms']:.0f} "
                                     "ms", f"{o['round_ms'] / r['round_ms']:.2f}x faster round"]
    return [f"{o['tok_s']:.1f}", "", f"{r['tok_s'] / o['tok_s']:.2f}x"]


def profile_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if "profile" not in r:
            continue
        out.append(f"\n{r['quant']} batch {r['batch']} {r['path']} ({r['seconds']:.1f} s"
                   + (f", padding {r['padding_share']:.0%} of row-steps" if "padding_share" in r else "") + ")")
        out.append("| phase | s | share | calls |\n|---|---|---|---|")
        out += [f"| {p['phase']} | {p['seconds']:.2f} | {p['share']:.1%} | {p['calls']} |" for p in r["profile"]]
    return "\n".join(out)


def run_before(tree: str, quant: str, batch: int, args, profiled: bool) -> list[dict]:
    """The same config on another checkout (the code before a change), in a subprocess
    that imports that checkout's specft; returns its rows."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "before.json"
        cmd = [sys.executable, str(Path(tree) / "scripts" / "bench_decode.py"), "--quants", quant,
               "--batches", str(batch), "--paths", ",".join(args.paths), "--prompt-len", str(args.prompt_len),
               "--new-tokens", str(args.new_tokens), "--spec-tokens", str(args.spec_tokens),
               "--profile", f"{quant}:{batch}" if profiled else "", "--label", "before", "--out", str(out),
               "--dtype", args.before_dtype]
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        subprocess.run(cmd, cwd=tree, env=env, check=True)
        return json.loads(out.read_text())["rows"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quants", default="mxfp4,fp8,bf16")
    ap.add_argument("--batches", default="16,1,64")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--spec-tokens", type=int, default=32, help="new tokens for the speculative rows")
    ap.add_argument("--profile", default="mxfp4:16", help="quant:batch pairs profiled (comma-separated)")
    ap.add_argument("--draft-vocab", default="32000",
                    help="the random draft's vocabulary size(s), comma-separated: one speculative row each")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "bench_decode.json"))
    ap.add_argument("--against", help="a checkout of the code before a change (e.g. a git worktree, with this "
                    "script copied in): each config runs there first, then here, side by side")
    ap.add_argument("--dtype", default="auto", help="the target's compute dtype; auto: what specft picks "
                    "for this machine (bfloat16 where the CPU has AVX512-BF16 or AMX, else float32)")
    ap.add_argument("--before-dtype", default="float32", help="the dtype the --against checkout runs in")
    args = ap.parse_args()
    args.paths = args.paths.split(",")
    if args.dtype == "auto":
        from specft.device import resolve_dtype

        args.dtype = resolve_dtype("auto")
    from specft.target_model import load_tokenizer

    mcfg, _ = _configs("bf16")
    batches = [int(b) for b in args.batches.split(",")]
    prompts = build_prompts(load_tokenizer(mcfg), max(batches + [4]), args.prompt_len)
    info = machine()
    print(f"machine: {info}", flush=True)
    profiled = set(args.profile.split(",")) if args.profile else set()
    rows, before = [], []
    for quant in args.quants.split(","):
        for batch in batches:
            if args.against:
                before += run_before(args.against, quant, batch, args, f"{quant}:{batch}" in profiled)
            rows += bench_one(quant, batch, args, prompts, f"{quant}:{batch}" in profiled)
            _write(args, info, prompts, rows, before)  # after every config: a stopped run keeps its rows
    old = {(r["quant"], r["batch"], r["path"]): r for r in before if "tok_s" in r or r["path"] == "roofline"} or None
    print(table(rows, old))
    print(profile_table(rows))
    if before:
        print("\nbefore:" + profile_table(before))
    print(f"wrote {args.out}")


def _write(args, info, prompts, rows, before) -> None:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"label": args.label, "machine": info, "args": vars(args),
                                          "prompt_lens": [len(p) for p in prompts], "rows": rows,
                                          "before": before}, indent=1))


if __name__ == "__main__":
    main()
