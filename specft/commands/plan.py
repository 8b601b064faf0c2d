"""`specft plan`: per-rank memory and cache write rate for stage 1 from the model config
alone, for each device count, and a refusal when a plan does not fit.

Formulas (all bytes; B*T = cache.batch_size x data.max_seq_len tokens per forward):
- quant=checkpoint: the checkpoint's stored size from its quantization_config (codes plus
  scales and zero points per group or block: HF FP8 8 + 32/16384, AWQ/GPTQ int4 group 128
  4 + 20/128). The rows count what specft holds: dequantized to 16 bit on load
  (model.checkpoint_weights=dense), partitioned over the ranks as a 16-bit target is under
  zero3 (written into the partitions as it loads) and whole on every rank otherwise; or
  the stored bytes plus one dense Linear in flight (packed), whole on every rank.
- weights: Linear weights of the quantized layers at the format's bits (element bits plus
  the scale's bits per block: MXFP4 4 + 8/32, NVFP4 4 + 8/16, FP8 per channel 8 + 32/in),
  everything the quant config excludes (embeddings, lm_head, MoE router) and the norms in
  16 bit. ZeRO-3 partitions all of it evenly over the ranks and gathers one layer at a
  time (two in flight with prefetch); TP splits the Linear layers and replicates the rest.
- activations: B*T * (2H + (heads + 2 kv_heads) * head_dim + 2 * I_active) * 2 (bf16, one
  layer in flight) + the captured features B*T * 4H * 4 (fp32, 3 aux + final).
- KV (regeneration only; stage 1 capture runs without a cache): B*T * layers * 2 *
  kv_heads * head_dim * 2, split over TP ranks.
- write rate: forward tokens/s per rank = device FLOP/s * MFU / (2 * active params per
  token, lm_head excluded), times the cache's bytes per token (4H values + 9 bytes).
- cache or online, for N samples of T tokens (plan.samples, plan.tokens_per_sample): the
  cache takes N * T * bytes per token on disk and one target pass, N * T / forward
  tokens/s device-seconds; online training (trainer.features=online) writes nothing and
  pays the target's forward over each step's tokens instead, micro_batch_size *
  grad_accum * T / forward tokens/s seconds per rank and step: one target pass per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

from specft.common.errors import SpecftError
from specft.config import ModelConfig, PlanConfig
from specft.quant.config import QuantConfig
from specft.quant.fake_quant import SCHEMES
from specft.quant.formats import ELEMENT_FORMATS

GB = 1e9


@dataclass
class ParamCounts:
    linear: int  # quantizable Linear weights (attention, MLP / experts)
    linear_in_features: float  # mean reduction size (per-channel scale overhead)
    other: int  # 16-bit: embeddings, lm_head, router, norms
    active: int  # per token in stage 1 (no lm_head)
    layer_bytes_16bit: float  # one decoder layer in bf16 (ZeRO-3 gather buffer)


def param_counts(m: ModelConfig) -> ParamCounts:
    h, hd = m.hidden_size, m.head_dim or m.hidden_size // m.num_heads
    attn = h * m.num_heads * hd * 2 + h * m.num_kv_heads * hd * 2
    mlp_one = 3 * h * m.intermediate_size
    experts = m.num_experts or 1
    router = h * m.num_experts if m.num_experts else 0
    norms = 2 * h + (2 * hd if m.family in ("qwen3", "qwen3_moe") else 0)
    embed = m.vocab_size * h
    head = 0 if m.tie_word_embeddings else m.vocab_size * h
    linear = m.num_layers * (attn + experts * mlp_one)
    active_mlp = (m.experts_top_k or 1) * mlp_one
    return ParamCounts(
        linear=linear,
        linear_in_features=(h * 5 + m.intermediate_size) / 6,
        other=embed + head + m.num_layers * (router + norms) + h,
        active=m.num_layers * (attn + active_mlp + router),
        layer_bytes_16bit=2.0 * (attn + experts * mlp_one + router + norms),
    )


def weight_bits(q: QuantConfig, in_features: float) -> float:
    if q.weight is None:
        return 16.0
    scheme = SCHEMES[q.weight.scheme]
    return ELEMENT_FORMATS[q.weight.format].bits + scheme.scale_bits / scheme.elements_per_scale(q.weight, in_features)


def stored_linear_bits(m: ModelConfig, in_features: float) -> tuple[float, str]:
    """quant=checkpoint: bits per quantized Linear weight element as the checkpoint stores
    them (codes, scales, zero points), and where the figure comes from."""
    from pathlib import Path

    from specft.quantized_checkpoints import stored_bits

    found = stored_bits(Path(m.path).expanduser(), in_features) if m.path else None
    if found is None:
        return 16.0, "checkpoint (not quantized: 16 bit)"
    family, bits = found
    if bits is None:
        return 16.0, f"checkpoint {family} (its stored size is not known to plan: counted at 16 bit)"
    return bits, f"checkpoint {family}, {bits:.2f} bits per weight as stored"


def _resident_bits(m: ModelConfig, q: QuantConfig, in_features: float) -> float:
    """Bits a Linear weight element takes in memory while stage 1 runs: a checkpoint's
    stored bits when kept packed (model.checkpoint_weights=packed), else the format's."""
    if q.from_checkpoint and m.checkpoint_weights == "packed":
        return stored_linear_bits(m, in_features)[0]
    return weight_bits(q, in_features)


def _dense_in_flight(m: ModelConfig, head_dim: int) -> float:
    """Packed: the one Linear dequantized for its forward (the largest, 16 bit)."""
    if m.checkpoint_weights != "packed":
        return 0.0
    return 2.0 * max(m.hidden_size * m.intermediate_size, m.hidden_size * m.num_heads * head_dim)


def _checkpoint_whole(m: ModelConfig, q: QuantConfig, p: PlanConfig) -> bool:
    """A checkpoint loads whole on every rank unless it is dense under zero3 (tp refuses
    a checkpoint; packed weights are not partitioned)."""
    return q.from_checkpoint and (p.strategy != "zero3" or m.checkpoint_weights == "packed")


def plan_rows(m: ModelConfig, q: QuantConfig, p: PlanConfig, tokens_per_forward: int,
              cache_bytes_per_token: float) -> list[dict]:
    c = param_counts(m)
    hd = m.head_dim or m.hidden_size // m.num_heads
    linear_bytes = c.linear * _resident_bits(m, q, c.linear_in_features) / 8
    other_bytes = 2.0 * c.other
    i_active = (m.experts_top_k or 1) * m.intermediate_size
    act = tokens_per_forward * (2 * m.hidden_size + (m.num_heads + 2 * m.num_kv_heads) * hd + 2 * i_active) * 2 \
        + tokens_per_forward * 4 * m.hidden_size * 4
    kv = tokens_per_forward * m.num_layers * 2 * m.num_kv_heads * hd * 2
    tok_s = p.device_tflops * 1e12 * p.mfu / (2 * c.active)
    rows = []
    for n in p.devices:
        if _checkpoint_whole(m, q, p):
            weights, kv_rank = linear_bytes + other_bytes + _dense_in_flight(m, hd), kv
        elif p.strategy == "zero3":
            weights = (linear_bytes + other_bytes) / n + 2 * c.layer_bytes_16bit * (linear_bytes / (2.0 * c.linear))
            kv_rank = kv
        else:  # tp: Linear layers split, the rest replicated
            weights = linear_bytes / n + other_bytes
            kv_rank = kv / min(n, m.num_kv_heads)
        total = weights + act + (kv_rank if p.with_kv else 0)
        rows.append({"devices": n, "weights_gb": weights / GB, "activations_gb": act / GB,
                     "kv_gb": kv_rank / GB if p.with_kv else 0.0, "total_gb": total / GB,
                     "fits": total <= p.device_memory_gb * GB * p.headroom,
                     "tokens_per_s_per_rank": tok_s, "write_mb_per_s_per_rank": tok_s * cache_bytes_per_token / 1e6})
    return rows


def format_plan(m: ModelConfig, q: QuantConfig, p: PlanConfig, rows: list[dict]) -> str:
    c = param_counts(m)
    lines = [f"plan: {m.name} / {q.name}, {p.strategy}, {p.device_memory_gb:g} GB per device "
             f"({(c.linear + c.other) / 1e9:.1f}B params, {c.active / 1e9:.1f}B active per token)"]
    if q.from_checkpoint:
        bits, source = stored_linear_bits(m, c.linear_in_features)
        held = ("kept packed (model.checkpoint_weights=packed), one layer dequantized at a time"
                if m.checkpoint_weights == "packed" else "dequantized on load (model.checkpoint_weights=dense)")
        where = "whole on every rank" if _checkpoint_whole(m, q, p) else "partitioned over the ranks"
        lines.append(f"checkpoint: {(c.linear * bits / 8 + 2.0 * c.other) / GB:.1f} GB as stored ({source}; "
                     f"the rest 16 bit); {held}, {where}")
    lines.append(f"{'devices':>8} {'weights':>9} {'activ.':>8} {'KV':>8} {'total':>9} {'fits':>5} {'tok/s':>8} "
                 f"{'write MB/s':>11}")
    for r in rows:
        lines.append(f"{r['devices']:>8} {r['weights_gb']:8.1f}G {r['activations_gb']:7.2f}G {r['kv_gb']:7.2f}G "
                     f"{r['total_gb']:8.1f}G {'yes' if r['fits'] else 'NO':>5} {r['tokens_per_s_per_rank']:8.0f} "
                     f"{r['write_mb_per_s_per_rank']:11.1f}")
    return "\n".join(lines)


def cache_or_online_rows(cfg, cache_bytes_per_token: float, forward_tokens_per_s: float) -> list[dict]:
    """Per data-set size: the cache on disk and the target pass that writes it, against
    the target forward online training adds to every step (see the module doc)."""
    t = cfg.plan.tokens_per_sample or cfg.data.max_seq_len
    step_tokens = cfg.trainer.micro_batch_size * cfg.trainer.grad_accum * t
    return [{"samples": n, "tokens_per_sample": t, "cache_tb": n * t * cache_bytes_per_token / 1e12,
             "target_pass_device_hours": n * t / forward_tokens_per_s / 3600,
             "online_s_per_step_per_rank": step_tokens / forward_tokens_per_s}
            for n in cfg.plan.samples]


def format_cache_or_online(cfg, rows: list[dict]) -> str:
    lines = [f"cache or online: samples of {rows[0]['tokens_per_sample']} tokens, cache.dtype={cfg.cache.dtype}; "
             f"online adds the target's forward to every step "
             f"({cfg.trainer.micro_batch_size} x {cfg.trainer.grad_accum} samples per rank)",
             f"{'samples':>10} {'cache':>10} {'target pass (device-h)':>23} {'online: +s per step':>20}"]
    for r in rows:
        size = f"{r['cache_tb']:.2f} TB" if r["cache_tb"] >= 1 else f"{1000 * r['cache_tb']:.1f} GB"
        lines.append(f"{r['samples']:>10} {size:>10} {r['target_pass_device_hours']:23.1f} "
                     f"{r['online_s_per_step_per_rank']:20.2f}")
    return "\n".join(lines)


def run_plan(cfg) -> list[dict]:
    from specft.cache.storage import bytes_per_token
    from specft.config import aux_layer_ids

    tokens = cfg.cache.batch_size * cfg.data.max_seq_len
    # as the cache writer estimates it: every cached layer's values, token id and loss mask
    per_token = bytes_per_token(cfg.cache.dtype, cfg.model.hidden_size, len(aux_layer_ids(cfg.model)) + 1) + 5
    rows = plan_rows(cfg.model, cfg.quant, cfg.plan, tokens, per_token)
    print(format_plan(cfg.model, cfg.quant, cfg.plan, rows))
    if cfg.plan.samples:
        print(format_cache_or_online(cfg, cache_or_online_rows(cfg, per_token, rows[0]["tokens_per_s_per_rank"])))
    if not any(r["fits"] for r in rows):
        raise SpecftError(f"plan: {cfg.model.name} / {cfg.quant.name} does not fit {cfg.plan.device_memory_gb:g} GB "
                          f"devices at {', '.join(map(str, cfg.plan.devices))} ranks; add devices or lower "
                          f"cache.batch_size / data.max_seq_len")
    return rows
