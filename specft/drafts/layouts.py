"""Serving layouts (a registry): how a specft draft's tensors and config are named for
each engine; each draft architecture's folder registers its own (eagle3/export.py,
mtp/export.py) from the shared pieces here. Checked against the public sources listed
in docs/export.md.

- ``eagle3``: the EAGLE-3 checkpoint vLLM (`Eagle3LlamaForCausalLM`) and SGLang
  (`LlamaForCausalLMEagle3`) load: fc, midlayer.*, norm, lm_head, d2t (int64 offsets),
  t2d (bool); embed_tokens only when the draft learned its own. Aux layer ids are
  written in vLLM's convention (id j = the input of decoder layer j, i.e. the output of
  layer j-1), so specft's output-of-layer ids are shifted by one.
- ``speculators``: vllm-project/speculators' Eagle3Speculator: the same tensors with all
  decoder layers under ``layers.{i}`` (``midlayer`` is ``layers.0``), config split into
  transformer_layer_config and speculators_config.
- ``mtp``: DeepSeek-V3's MTP layer, stored as the layer after the target's last:
  model.layers.{N}.{enorm, hnorm, eh_proj, embed_tokens, shared_head.norm,
  shared_head.head, input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}.
- ``gguf``: llama.cpp's draft file, which its own converter writes from one of the layouts
  above (export/gguf.py); a draft folder that llama.cpp can take registers how in
  LLAMACPP_DRAFTS (eagle3/export.py, dflash/export.py), with what it refuses.

Every layout names the writer that makes its files (export/writers.py): ``safetensors``
(the tensors and config.json of the classes here) or ``gguf``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specft.common.registry import Registry

LAYOUTS: Registry = Registry("export layout")


class SafetensorsLayout:
    """A layout written as model.safetensors + config.json: a subclass says how the draft's
    tensors and config are named (``tensors``, ``config``)."""

    writer = "safetensors"


@LAYOUTS.register("gguf")
class GgufLayout:
    writer = "gguf"


@dataclass(frozen=True)
class LlamaCppDraft:
    """How llama.cpp takes a draft architecture under ``--layout gguf``."""

    hf_layout: str  # the safetensors layout llama.cpp's converter reads
    spec_type: str  # llama-server --spec-type
    architecture: str  # general.architecture the converter writes
    refusal: Callable[[dict], str | None]  # draft meta -> why llama.cpp cannot take it, if it cannot
    # llama.cpp's drafter reads nothing of the draft's own vocabulary (its tokens are the
    # target's), so the GGUF may go without the copy the converter writes (--gguf-vocab none)
    vocabulary_optional: bool = False


# specft draft architecture -> how llama.cpp takes it, registered by the draft's folder
LLAMACPP_DRAFTS: Registry[LlamaCppDraft] = Registry("llama.cpp draft")


# The draft's decoder layer is a Llama layer, or a Qwen3 one when it has q/k norm:
# (model_type, vLLM's EAGLE-3 architecture, the plain architecture of that layer).
LAYER_KINDS = {
    "llama": ("llama", "LlamaForCausalLMEagle3", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Eagle3Qwen3ForCausalLM", "Qwen3ForCausalLM"),
}
DEFAULT_MAX_POSITIONS = 32768  # when nothing records the target's limit


def layer_kind(meta: dict) -> str:
    return "qwen3" if meta.get("qk_norm") else "llama"


def decoder_block(c: dict) -> dict:
    """The HF config fields of the draft's decoder layer(s); the position limit follows
    the target's (a draft cannot be asked for positions its verifier does not have)."""
    block = {"model_type": LAYER_KINDS[layer_kind(c)][0], "hidden_size": c["hidden_size"],
             "intermediate_size": c["intermediate_size"],
             "num_attention_heads": c["num_heads"], "num_key_value_heads": c["num_kv_heads"],
             "head_dim": c["head_dim"], "num_hidden_layers": c["num_layers"], "hidden_act": "silu",
             "rms_norm_eps": c["rms_norm_eps"], "rope_theta": c["rope_theta"],
             "max_position_embeddings": (c.get("verifier") or {}).get("max_position_embeddings")
             or DEFAULT_MAX_POSITIONS,
             "vocab_size": c["target_vocab_size"], "tie_word_embeddings": False}
    if layer_kind(c) == "qwen3":
        block["attention_bias"] = False
    return block


def vllm_aux_ids(meta: dict) -> list[int]:
    return [i + 1 for i in meta["aux_layer_ids"]]


def verifier_block(meta: dict) -> dict:
    """speculators' verifier block: where vLLM finds the target when it is given only the
    export (`vllm serve EXPORT`)."""
    v = meta.get("verifier") or {}
    return {"name_or_path": v.get("name_or_path") or meta.get("target_model"),
            "architectures": list(v.get("architectures") or [])}


def serving_tensors(state: dict, meta: dict) -> dict:
    """A draft's state as serving engines read it: without draft_to_target (specft's own
    index), without the frozen copy of the target's embedding (the engine shares the
    target's), and without d2t/t2d for a draft over the whole target vocabulary (vLLM then
    builds no id map and refuses one in the checkpoint)."""
    full_vocab = "d2t" in state and not state["d2t"].any() and bool(state["t2d"].all())
    return {name: t for name, t in state.items()
            if name != "draft_to_target" and not (full_vocab and name in ("d2t", "t2d"))
            and not (name.startswith("embed_tokens") and not meta["learned_embedding"])}
