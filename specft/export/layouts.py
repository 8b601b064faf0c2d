"""Serving layouts (a registry): how a specft draft's tensors and config are named for
each engine. Checked against the public sources listed in docs/export.md.

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
"""

from __future__ import annotations

import torch

from specft.errors import SpecftError
from specft.registry import Registry

LAYOUTS: Registry = Registry("export layout")


# The draft's decoder layer is a Llama layer, or a Qwen3 one when it has q/k norm:
# (model_type, vLLM's EAGLE-3 architecture, the plain architecture of that layer).
LAYER_KINDS = {
    "llama": ("llama", "LlamaForCausalLMEagle3", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Eagle3Qwen3ForCausalLM", "Qwen3ForCausalLM"),
}
DEFAULT_MAX_POSITIONS = 32768  # when nothing records the target's limit


def layer_kind(meta: dict) -> str:
    return "qwen3" if meta.get("qk_norm") else "llama"


def _decoder_block(c: dict) -> dict:
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


def _eagle3_tensors(state: dict, meta: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if name in ("draft_to_target",) or name.startswith("embed_tokens") and not meta["learned_embedding"]:
            continue
        if name.startswith("extra_layers."):
            index, rest = name[len("extra_layers."):].split(".", 1)
            name = f"layers.{int(index) + 1}.{rest}"
        out[name] = t
    return out


@LAYOUTS.register("eagle3")
class Eagle3Layout:
    def config(self, meta: dict) -> dict:
        ids = vllm_aux_ids(meta)
        return {"architectures": [LAYER_KINDS[layer_kind(meta)][1]], **_decoder_block(meta),
                "draft_vocab_size": meta["draft_vocab_size"], "target_hidden_size": meta["target_hidden_size"],
                "eagle_aux_hidden_state_layer_ids": ids,
                "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ids}}

    def tensors(self, state: dict, meta: dict, target_head) -> dict[str, torch.Tensor]:
        return _eagle3_tensors(state, meta)


@LAYOUTS.register("speculators")
class SpeculatorsLayout:
    def config(self, meta: dict) -> dict:
        return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "transformer_layer_config": {"architectures": [LAYER_KINDS[layer_kind(meta)][2]],
                                             **_decoder_block(meta)},
                "draft_vocab_size": meta["draft_vocab_size"], "target_hidden_size": meta["target_hidden_size"],
                "norm_before_residual": False,
                "eagle_aux_hidden_state_layer_ids": vllm_aux_ids(meta),
                "speculators_config": {
                    "algorithm": "eagle3", "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": meta.get("ttt_steps", 3)}],
                    "verifier": _verifier(meta)}}

    def tensors(self, state: dict, meta: dict, target_head) -> dict[str, torch.Tensor]:
        # speculators' Eagle3DraftModel holds all decoder layers in one `layers` list.
        return {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
                for k, v in _eagle3_tensors(state, meta).items()}


def _verifier(meta: dict) -> dict:
    """speculators' verifier block: where vLLM finds the target when it is given only the
    export (`vllm serve EXPORT`)."""
    v = meta.get("verifier") or {}
    return {"name_or_path": v.get("name_or_path") or meta.get("target_model"),
            "architectures": list(v.get("architectures") or [])}


@LAYOUTS.register("mtp")
class MtpLayout:
    def config(self, meta: dict) -> dict:
        if meta.get("qk_norm"):
            raise SpecftError("export: the mtp layout's decoder layer (DeepSeek-V3) has no q/k norm; "
                              "train with draft.qk_norm=false to export it")
        return {"architectures": ["DeepseekV3ForCausalLM"], **_decoder_block(meta), "num_hidden_layers":
                meta["target_num_layers"], "num_nextn_predict_layers": 1,
                "draft_vocab_size": meta["target_vocab_size"]}

    def tensors(self, state: dict, meta: dict, target_head) -> dict[str, torch.Tensor]:
        d2t_ids = state["draft_to_target"]
        if len(d2t_ids) == meta["target_vocab_size"] and torch.equal(d2t_ids, torch.arange(len(d2t_ids))):
            head = state["head_weight"]
        elif target_head is not None:
            head = target_head
        else:
            raise SpecftError("export: an mtp layout carries the full shared head; this draft's vocabulary is "
                              f"{len(d2t_ids)} of {meta['target_vocab_size']} tokens: pass --target-head "
                              "CACHE/target_head.safetensors")
        prefix = f"model.layers.{meta['target_num_layers']}."
        out = {prefix + "shared_head.head.weight": head}
        for name, t in state.items():
            if name in ("draft_to_target", "d2t", "t2d", "head_weight"):
                continue
            out[prefix + (name[len("block."):] if name.startswith("block.") else name)] = t
        return out
