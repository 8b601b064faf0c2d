"""EAGLE-3's serving layouts: eagle3 (vLLM / SGLang checkpoints), speculators, and gguf
(llama.cpp's converter reads the eagle3 layout; its EAGLE3 graph has a Llama decoder layer)."""

from __future__ import annotations

import torch

from specft.drafts.layouts import (
    LAYER_KINDS,
    LAYOUTS,
    LLAMACPP_DRAFTS,
    LlamaCppDraft,
    SafetensorsLayout,
    decoder_block,
    layer_kind,
    serving_tensors,
    verifier_block,
    vllm_aux_ids,
)


def _eagle3_tensors(state: dict, meta: dict) -> dict[str, torch.Tensor]:
    """Serving tensors, extra decoder layers named as the engines' layers.{i}."""
    out = {}
    for name, t in serving_tensors(state, meta).items():
        if name.startswith("extra_layers."):
            index, rest = name[len("extra_layers."):].split(".", 1)
            name = f"layers.{int(index) + 1}.{rest}"
        out[name] = t
    return out


@LAYOUTS.register("eagle3")
class Eagle3Layout(SafetensorsLayout):
    # What vLLM's speculative_config needs beside the model and k to draft with it.
    vllm_speculative = {"method": "eagle3"}

    def config(self, meta: dict) -> dict:
        ids = vllm_aux_ids(meta)
        return {"architectures": [LAYER_KINDS[layer_kind(meta)][1]], **decoder_block(meta),
                "draft_vocab_size": meta["draft_vocab_size"], "target_hidden_size": meta["target_hidden_size"],
                "eagle_aux_hidden_state_layer_ids": ids,
                "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ids}}

    def tensors(self, state: dict, meta: dict, target_head) -> dict[str, torch.Tensor]:
        return _eagle3_tensors(state, meta)


@LAYOUTS.register("speculators")
class SpeculatorsLayout(SafetensorsLayout):
    vllm_speculative = {"method": "eagle3"}

    def config(self, meta: dict) -> dict:
        return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "transformer_layer_config": {"architectures": [LAYER_KINDS[layer_kind(meta)][2]],
                                             **decoder_block(meta)},
                "draft_vocab_size": meta["draft_vocab_size"], "target_hidden_size": meta["target_hidden_size"],
                "norm_before_residual": False,
                "eagle_aux_hidden_state_layer_ids": vllm_aux_ids(meta),
                "speculators_config": {
                    "algorithm": "eagle3", "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": meta.get("ttt_steps", 3)}],
                    "verifier": verifier_block(meta)}}

    def tensors(self, state: dict, meta: dict, target_head) -> dict[str, torch.Tensor]:
        # speculators' Eagle3DraftModel holds all decoder layers in one `layers` list.
        return {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
                for k, v in _eagle3_tensors(state, meta).items()}


def _llamacpp_refusal(meta: dict) -> str | None:
    """llama.cpp's EAGLE3 graph (src/models/eagle3.cpp) has a Llama decoder layer, no q/k norm."""
    if meta.get("qk_norm"):
        return ("this draft's decoder layer has q/k norm (a Qwen3 layer), which llama.cpp's EAGLE3 graph does "
                "not compute; train it with draft.qk_norm=false to serve it with llama.cpp")
    return None


# common/speculative.cpp's EAGLE-3 drafter samples target token ids (the graph applies d2t) and,
# with specft's patch 0002, spells them with the target's vocabulary: the draft needs none.
LLAMACPP_DRAFTS.register("eagle3")(LlamaCppDraft("eagle3", "draft-eagle3", "eagle3", _llamacpp_refusal,
                                                 vocabulary_optional=True))
