"""EAGLE-3's serving layouts: eagle3 (vLLM / SGLang checkpoints) and speculators."""

from __future__ import annotations

import torch

from specft.drafts.layouts import (
    LAYER_KINDS,
    LAYOUTS,
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
class Eagle3Layout:
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
class SpeculatorsLayout:
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
