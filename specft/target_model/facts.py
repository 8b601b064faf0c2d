"""A model config that follows its checkpoint: ``model=hf model.path=DIR`` reads the
architecture facts (layers, widths, heads, vocabulary, experts) from DIR/config.json, so
any local Hugging Face causal LM needs no YAML of its own. Facts given in the config or
on the command line win; the loader still checks them against the checkpoint."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specft.common.errors import ConfigError
from specft.config import MODEL_FAMILIES
from specft.quantized_checkpoints.base import read_config
from specft.quantized_checkpoints.gguf_family import hf_config, is_gguf_file

# ModelConfig field -> config.json keys, first present wins (Qwen3-MoE: per-expert width)
FACT_KEYS = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": ("hidden_size",),
    "intermediate_size": ("moe_intermediate_size", "intermediate_size"),
    "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads", "num_attention_heads"),
    "head_dim": ("head_dim",),
    "vocab_size": ("vocab_size",),
    "num_experts": ("num_local_experts", "num_experts"),
    "experts_top_k": ("num_experts_per_tok",),
    "tie_word_embeddings": ("tie_word_embeddings",),
}
FAMILY_AUTO = "auto"


def checkpoint_facts(model_dir: Path) -> dict:
    """ModelConfig facts from a checkpoint's config.json (text config of a multimodal one),
    or from the header of a .gguf file."""
    raw = hf_config(model_dir).to_dict() if model_dir.suffix == ".gguf" else read_config(model_dir)
    raw = raw.get("text_config", raw)
    facts = {field: next((raw[k] for k in keys if raw.get(k) is not None), None) for field, keys in FACT_KEYS.items()}
    if facts["head_dim"] is None and facts["hidden_size"] and facts["num_heads"]:
        facts["head_dim"] = facts["hidden_size"] // facts["num_heads"]
    # Dense checkpoints have no experts; absent means untied (transformers' default).
    facts.update({k: v for k, v in (("num_experts", 0), ("experts_top_k", 0), ("tie_word_embeddings", False))
                  if facts[k] is None})
    model_type = raw.get("model_type", "")
    # A family's draft and export layout; any other decoder is the generic (Llama) one.
    facts["family"] = model_type if model_type in MODEL_FAMILIES else "llama"
    return {k: v for k, v in facts.items() if v is not None}


def _required(model: DictConfig, key: str) -> bool:
    """A fact the config does not have at all (missing, or family: auto)."""
    return key not in model or OmegaConf.is_missing(model, key) or (key == "family" and model.get(key) == FAMILY_AUTO)


def _unset(model: DictConfig, key: str) -> bool:
    """Left for the checkpoint to say: required, null, or the schema's default (0
    experts, untied), since a YAML '???' cannot override a default in a merge."""
    if _required(model, key):
        return True
    value = model.get(key)
    return value is None or (key in ("num_experts", "experts_top_k", "tie_word_embeddings") and not value)


def fill_model_facts(cfg: DictConfig) -> None:
    """Fill the model facts left unset (or family: auto) from model.path, when it is a
    local checkpoint directory."""
    model = cfg.get("model")
    if model is None or model.get("source") != "hf":
        return
    wanted = [k for k in (*FACT_KEYS, "family") if _unset(model, k)]
    if not wanted:
        return
    path = None if OmegaConf.is_missing(model, "path") else model.get("path")
    model_dir = Path(str(path)).expanduser() if path else None
    gguf = model_dir is not None and is_gguf_file(model_dir)
    if not gguf and (model_dir is None or not (model_dir / "config.json").is_file()):
        if not any(_required(model, k) for k in wanted):  # defaults only: a hub id with its facts in YAML
            return
    if not path:
        raise ConfigError(f"model.path: model={model.get('name')} reads its architecture from a local "
                          "checkpoint; give model.path=DIR")
    if not gguf and not (model_dir / "config.json").is_file():
        ggufs = sorted(p.name for p in model_dir.glob("*.gguf")) if model_dir.is_dir() else []
        if ggufs:
            raise ConfigError(f"model.path: {path} holds no config.json but {len(ggufs)} .gguf file(s) "
                              f"({', '.join(ggufs[:3])}); give model.path=DIR/{ggufs[0]} quant=checkpoint to run "
                              "the GGUF as llama.cpp does")
        raise ConfigError(f"model.path: {path} is not a checkpoint directory (no config.json); model="
                          f"{model.get('name')} reads {wanted[0]} and the other facts from it")
    facts = checkpoint_facts(model_dir)
    for key in wanted:
        if key in facts:
            OmegaConf.update(cfg, f"model.{key}", facts[key], force_add=True)
