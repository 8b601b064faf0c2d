"""`specft eval`: decode held-out prompts with the quantized target alone and with each
draft, for every k and batch size; record what users care about."""

from __future__ import annotations

import logging
import resource
from pathlib import Path

import torch

from specft.common.errors import SpecftError
from specft.common.progress import progress_bar
from specft.config import RootConfig, aux_layer_ids
from specft.decoding import DecodeStats, SamplingConfig, SpecDecoder
from specft.device import resolve_dtype
from specft.drafts import DRAFT_ARCHS
from specft.eval.prompts import load_prompts
from specft.eval.stats import confidence, paired_difference

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def load_quantized_target(cfg: RootConfig, prompts: list[list[int]], dtype: torch.dtype):
    from specft.quant import apply_quant, calibrate
    from specft.target_model import load_target

    model, _ = load_target(cfg.model)
    report = apply_quant(model, cfg.quant)
    if cfg.quant.needs_calibration:
        calibrate(model, report, ({"input_ids": torch.tensor([p])}
                                  for p in prompts[: cfg.quant.calibration_samples]))
    return model.to(dtype).eval()


def _bytes(module, shared_with=None) -> int:
    """Bytes of a module's parameters and buffers, less those it shares with ``shared_with``."""
    seen = {t.data_ptr() for t in [*shared_with.parameters(), *shared_with.buffers()]} if shared_with else set()
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]
               if t.data_ptr() not in seen)


def _load_drafts(cfg: RootConfig, dtype) -> list[tuple[str, object, dict]]:
    from specft.eval.drafts import load_draft, resolve_checkpoint

    e = cfg.eval
    paths = e.drafts or [str(Path(cfg.run_dir) / "checkpoints" / "final")]
    labels = e.labels or [resolve_checkpoint(p).parent.parent.name for p in paths]
    out = []
    for label, path in zip(labels, paths):
        draft, meta = load_draft(path, dtype)
        check_draft_matches_target(meta, cfg, str(path))
        check_draft_length(meta, e.k, str(path))
        out.append((label, draft, meta))
    return out


def eval_device(name: str) -> torch.device:
    """eval.device: auto takes an NPU, else a GPU, else the CPU."""
    from specft.device import select_device

    try:
        return torch.device(select_device(None if name == "auto" else name).kind)
    except RuntimeError:
        raise SpecftError(f"eval.device: {name} is not available on this machine; use eval.device=auto or cpu") \
            from None


def check_draft_length(meta: dict, ks: list[int], path: str) -> None:
    """A parallel drafter fills only the slots it was trained with."""
    limit = meta.get("max_draft_tokens")
    if limit is not None and max(ks, default=0) > limit:
        raise SpecftError(f"eval.k: {path} is a {meta.get('architecture')} draft trained to draft at most {limit} "
                          f"tokens a round; got k={max(ks)} (allowed: 1..{limit})")


def check_draft_matches_target(meta: dict, cfg: RootConfig, path: str) -> None:
    """A draft meets only the target it was trained for: same model, width, aux layers and
    vocabulary (its quant may differ: that is the 16-bit baseline's case). A quantized
    checkpoint (quant=checkpoint) is named after its folder, not after the model it was
    made from, so against one the architecture facts decide alone."""
    m = cfg.model
    named = [] if cfg.quant.from_checkpoint else [("model", meta.get("target_model"), m.name)]
    facts = [*named,
             ("hidden size", meta.get("target_hidden_size"), m.hidden_size),
             ("aux layers", meta.get("aux_layer_ids"), aux_layer_ids(m)),
             ("vocabulary", meta.get("target_vocab_size"), m.vocab_size)]
    for what, trained, here in facts:
        if trained is not None and trained != here:
            raise SpecftError(f"eval.drafts: {path} was trained for another target ({what} {trained}; "
                              f"this target, model={m.name}, has {here})")


def decode_all(decoder: SpecDecoder, prompts, k: int, batch: int, cfg: RootConfig):
    e = cfg.eval
    s = SamplingConfig(e.temperature, e.top_p, e.top_k)
    total = DecodeStats(proposed_at=[0] * k, accepted_at=[0] * k)
    tokens = []
    for i in range(0, len(prompts), batch):
        res = decoder.generate(prompts[i: i + batch], k, e.max_new_tokens, s, e.min_confidence, seed=e.seed + i)
        tokens.extend(res.tokens)
        st = res.stats
        for f in ("proposed", "accepted", "rounds", "generated", "prefill_tokens", "prefill_s", "decode_s"):
            setattr(total, f, getattr(total, f) + getattr(st, f))
        total.proposed_at = [a + b for a, b in zip(total.proposed_at, st.proposed_at)]
        total.accepted_at = [a + b for a, b in zip(total.accepted_at, st.accepted_at)]
        total.peak_kv_bytes = max(total.peak_kv_bytes, st.peak_kv_bytes)
        total.per_prompt.extend(st.per_prompt)
    return tokens, total


def divergence(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """How far each output follows the target-alone output before the first difference."""
    compared, diverged = 0, 0
    for got, ref in zip(tokens, reference):
        n = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if n is None and len(got) != len(ref):
            n = min(len(got), len(ref))
        compared += (n + 1) if n is not None else len(ref)
        diverged += n is not None
    return {"rows_diverged": diverged, "rows": len(reference),
            "flip_rate": diverged / compared if compared else 0.0}


def _record(label: str, k: int, batch: int, st: DecodeStats, weights: int, prompts: int, seed: int) -> dict:
    per_seq_tokens = st.generated / prompts
    batches = -(-prompts // batch)
    return {
        "draft": label, "k": k, "batch_size": batch,
        "acceptance_rate": st.acceptance_rate, "acceptance_length": st.acceptance_length,
        **(confidence(st.per_prompt, seed) if k else {}),
        "acceptance_at": [a / p if p else 0.0 for a, p in zip(st.accepted_at, st.proposed_at)],
        "proposed": st.proposed, "accepted": st.accepted, "target_forwards": st.rounds,
        "generated_tokens": st.generated,
        # Time per output token of one sequence, decode phase (prefill reported apart).
        "latency_ms_per_token": 1000 * st.decode_s / (per_seq_tokens * batches) if per_seq_tokens else 0.0,
        "tokens_per_s": st.generated / st.decode_s if st.decode_s else 0.0,  # decode phase, all rows
        "prefill_tokens_per_s": st.prefill_tokens / st.prefill_s if st.prefill_s else 0.0,
        "prefill_s": st.prefill_s, "decode_s": st.decode_s,
        "weights_bytes": weights, "peak_kv_bytes": st.peak_kv_bytes,
        "memory_bytes": weights + st.peak_kv_bytes,
        "per_prompt": st.per_prompt,  # [rounds, proposed, accepted] per prompt, for later CIs
    }


def run_eval(cfg: RootConfig) -> Path:
    from specft.eval.drafts import share_target_embedding
    from specft.eval.report import write_reports
    from specft.target_model import load_tokenizer
    from specft.target_model.loader import stop_token_ids

    e = cfg.eval
    out_dir = Path(e.out_dir or Path(cfg.run_dir) / "eval").expanduser().resolve()
    dtype = DTYPES[resolve_dtype(cfg.model.dtype) if e.dtype == "auto" else e.dtype]
    device = eval_device(e.device)
    drafts = _load_drafts(cfg, dtype)  # first: a wrong or damaged draft fails before any work
    tokenizer = load_tokenizer(cfg.model)
    prompts, left_out = load_prompts(cfg, tokenizer)
    target = load_quantized_target(cfg, prompts, dtype).to(device)
    eos = stop_token_ids(tokenizer, target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    target_bytes = _bytes(target)
    for _, draft, meta in drafts:
        draft.to(device)
        meta["shares_target_embedding"] = share_target_embedding(draft, target)
    runs = [(None, None, 0)] if e.target_alone else []
    runs += [(label, draft, k) for label, draft, _ in drafts for k in e.k]
    records = []
    ids = aux_layer_ids(cfg.model)
    with progress_bar(len(runs) * len(e.batch_sizes), "eval", "run") as bar:
        for batch in e.batch_sizes:
            reference = None
            for label, draft, k in runs:
                runner = DRAFT_ARCHS.get(draft.architecture).runner(draft) if draft is not None else None
                decoder = SpecDecoder(target, runner, ids, eos, pad)
                tokens, st = decode_all(decoder, prompts, k, batch, cfg)
                weights = target_bytes + (_bytes(draft, shared_with=target) if draft is not None else 0)
                rec = _record(label or "target alone", k, batch, st, weights, len(prompts), e.seed)
                if label is None:
                    reference = tokens
                elif reference is not None and e.temperature == 0:
                    rec.update(divergence(tokens, reference))
                records.append(rec)
                bar.update()
                bar.set_postfix_str(f"{rec['draft']} k={k} b={batch} acc={rec['acceptance_rate']:.3f} "
                                    f"{rec['tokens_per_s']:.1f} tok/s", refresh=False)
    _relative(records)
    comparisons = compare_drafts(records, e.seed)
    meta = {"model": cfg.model.name, "quant": cfg.quant.name, "prompts": len(prompts), "prompts_left_out": left_out,
            "data": cfg.data.name, "split": cfg.data.split, "max_new_tokens": e.max_new_tokens,
            "temperature": e.temperature, "dtype": e.dtype, "device": str(device),
            "torch_threads": torch.get_num_threads(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "drafts": {label: meta for label, _, meta in drafts}}
    write_reports(out_dir, records, meta, comparisons)
    return out_dir


def compare_drafts(records: list[dict], seed: int) -> list[dict]:
    """Every pair of drafts decoded at the same k and batch size: b - a with its CI."""
    out = []
    for key in dict.fromkeys((r["k"], r["batch_size"]) for r in records if r["k"]):
        same = [r for r in records if (r["k"], r["batch_size"]) == key]
        for i, a in enumerate(same):
            for b in same[i + 1:]:
                diff = paired_difference(a["per_prompt"], b["per_prompt"], seed)
                out.append({"k": key[0], "batch_size": key[1], "a": a["draft"], "b": b["draft"], **diff})
    return out


def _relative(records: list[dict]) -> None:
    """Latency change against the first draft at the same k and batch size,
    (T_base - T_x) / T_base, and memory against the target alone."""
    drafts = [r["draft"] for r in records if r["k"]]
    first = drafts[0] if drafts else None
    base = {(r["k"], r["batch_size"]): r for r in records if r["draft"] == first}
    alone = {r["batch_size"]: r for r in records if r["k"] == 0}
    for r in records:
        b = base.get((r["k"], r["batch_size"]))
        if b is not None and b["latency_ms_per_token"]:
            r["latency_change_vs_first"] = \
                (b["latency_ms_per_token"] - r["latency_ms_per_token"]) / b["latency_ms_per_token"]
        a = alone.get(r["batch_size"])
        if a is not None:
            r["memory_vs_target_alone"] = r["memory_bytes"] / a["memory_bytes"] - 1
            if a["latency_ms_per_token"]:
                r["latency_change_vs_target_alone"] = \
                    (a["latency_ms_per_token"] - r["latency_ms_per_token"]) / a["latency_ms_per_token"]
