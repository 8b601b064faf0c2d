"""Which config fields name a cache: those that change the cached numbers, by name.

Stage 1 is the expensive stage. Keying the cache on whole config dataclasses would make
every new field (a logging option, a validation knob) re-key every existing cache and
silently recompute it. So each dataclass whose values reach the provenance lists its
fields here, keyed or not (with the reason), and tests/test_cache_key.py fails when a
field is added without being classified. A change to what the cached numbers mean bumps
CACHE_VERSION (provenance/hashes.py) instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specft.config import DataConfig, ModelConfig, RegenerateConfig
from specft.quant.config import QuantConfig
from specft.quant.fake_quant import TensorQuantSpec
from specft.quant.rotation import RotationSpec

# Fields that change the cached numbers: which conversations, their tokens and answers,
# and how the target computes (its weights, quantization and dtype).
KEYED: dict[type, tuple[str, ...]] = {
    ModelConfig: ("name", "source", "path", "gguf_file", "family", "num_layers", "hidden_size",
                  "vocab_size", "dtype"),
    DataConfig: ("name", "path", "num_samples", "max_seq_len", "overlength", "seed", "system_prompt",
                 "thinking", "messages_field", "prompt_field", "response_field", "hf_split", "hf_config",
                 "split", "val_fraction", "dedup", "min_turns", "max_turns", "min_response_chars",
                 "gsm8k_answers", "regenerate", "mix"),
    # batch_size: float32 padding effects flip a few greedy tokens between batch sizes.
    RegenerateConfig: ("enabled", "max_new_tokens", "temperature", "top_p", "top_k", "batch_size", "seed",
                       "fraction", "engine"),
    QuantConfig: ("name", "weight", "activation", "kv", "exclude", "calibration_samples", "rotation"),
    TensorQuantSpec: ("format", "scheme", "block_size", "scale_rule", "symmetric", "dynamic"),
    RotationSpec: ("residual", "head", "online_qk", "online_down", "seed"),
}

# Keyed fields that join the key only when set away from their default: fields added after
# caches were named under keys without them (a config that leaves them as they were keeps
# its old key).
KEYED_WHEN_SET: dict[type, tuple[str, ...]] = {QuantConfig: ("rotation",), RegenerateConfig: ("fraction", "engine"),
                                                DataConfig: ("gsm8k_answers",)}

# Fields that reach a keyed dataclass but not the cached numbers, and why.
NOT_KEYED: dict[type, dict[str, str]] = {
    ModelConfig: {
        field: "the checkpoint fingerprint covers the weights (tiny models: built under a shape digest)"
        for field in ("intermediate_size", "num_heads", "num_kv_heads", "head_dim", "num_experts",
                      "experts_top_k", "tie_word_embeddings")
    } | {"aux_layer_ids": "keyed resolved, as the provenance's aux_layer_ids",
         "checkpoint_weights": "packed and dense weights compute the same numbers, bit for bit "
                               "(tests/test_packed_checkpoints.py)"},
    DataConfig: {"keep_text": "only a data.mix member sets it (validated), and members are keyed as written"},
    RegenerateConfig: {"reuse": "reused answers are the same target's answers under the same settings",
                       "server": "where the server is and how it is called; what it serves is keyed as the "
                                 "provenance's answers (engines/server.py)"},
    # Only conf/quant/checkpoint.yaml sets it, whose name is keyed; what the checkpoint
    # quantizes is in the checkpoint fingerprint (its config.json and weight files).
    # Keying it would rename every existing cache.
    QuantConfig: {"from_checkpoint": "keyed by the quant name (checkpoint) and the checkpoint fingerprint"},
    TensorQuantSpec: {},
    RotationSpec: {},
}


def cache_key(obj: Any) -> Any:
    """``obj`` with every classified dataclass reduced to its keyed fields (recursively);
    other values as dataclasses.asdict would give them."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = KEYED.get(type(obj))
        if fields is None:
            raise TypeError(f"cache key: {type(obj).__name__} has no field classification in specft/provenance/keys.py")
        optional = KEYED_WHEN_SET.get(type(obj), ())
        return {name: cache_key(getattr(obj, name)) for name in fields
                if name not in optional or getattr(obj, name) != _default(type(obj), name)}
    if isinstance(obj, (list, tuple)):
        return [cache_key(v) for v in obj]
    if isinstance(obj, dict):
        return {k: cache_key(v) for k, v in obj.items()}
    return obj


def _default(cls: type, name: str) -> Any:
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()
