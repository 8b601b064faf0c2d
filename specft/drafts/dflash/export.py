"""DFlash's serving layout: the checkpoint vLLM's DFlash drafter loads
(``architectures: [DFlashDraftModel]``, qwen3_dflash.py) with
``speculative_config={"method": "dflash", ...}``: a Qwen3 decoder block config with
``dflash_config`` (mask_token_id, the target layers it reads in specft's output-of-layer
ids, which vLLM shifts by one itself, and non-causal attention within the block)."""

from __future__ import annotations

import torch

from specft.drafts.layouts import LAYOUTS, decoder_block, serving_tensors


@LAYOUTS.register("dflash")
class DFlashLayout:
    vllm_speculative = {"method": "dflash"}

    def config(self, meta: dict) -> dict:
        block = decoder_block({**meta, "qk_norm": True})  # DFlash layers are Qwen3 layers
        return {"architectures": ["DFlashDraftModel"], **block,
                "draft_vocab_size": meta["draft_vocab_size"], "target_hidden_size": meta["target_hidden_size"],
                "block_size": meta["max_draft_tokens"] + 1,
                "dflash_config": {"mask_token_id": meta["options"]["mask_token_id"],
                                  "target_layer_ids": list(meta["aux_layer_ids"]), "causal": False}}

    def tensors(self, state: dict, meta: dict, target_head) -> dict[str, torch.Tensor]:
        return serving_tensors(state, meta)
