"""DFlash's serving layout: the checkpoint vLLM's DFlash drafter loads
(``architectures: [DFlashDraftModel]``, qwen3_dflash.py) with
``speculative_config={"method": "dflash", ...}``: a Qwen3 decoder block config with
``dflash_config`` (mask_token_id, the target layers it reads in specft's output-of-layer
ids, which vLLM shifts by one itself, and non-causal attention within the block); and gguf,
which llama.cpp's converter writes from the dflash layout."""

from __future__ import annotations

import torch

from specft.drafts.layouts import (
    LAYOUTS,
    LLAMACPP_DRAFTS,
    LlamaCppDraft,
    SafetensorsLayout,
    decoder_block,
    serving_tensors,
)


@LAYOUTS.register("dflash")
class DFlashLayout(SafetensorsLayout):
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


def _llamacpp_refusal(meta: dict) -> str | None:
    """llama.cpp's DFlash converter keeps no draft vocabulary map (d2t), and its graph embeds
    with the target's own token embedding."""
    vocab = meta["target_vocab_size"]
    if (meta.get("draft_vocab_size") or vocab) != vocab:
        return (f"llama.cpp's DFlash converter keeps no draft vocabulary map (d2t), and this draft predicts "
                f"{meta['draft_vocab_size']} of the target's {vocab} tokens; train it with draft.vocab_size={vocab}")
    if meta["hidden_size"] != meta.get("target_hidden_size", meta["hidden_size"]):
        return (f"llama.cpp's DFlash graph embeds with the target's token embedding (width "
                f"{meta['target_hidden_size']}), and this draft is {meta['hidden_size']} wide; train it without "
                "draft.hidden_size")
    return None


# llama.cpp's DFlash drafter reads its mask token from the draft's own vocabulary: it keeps it.
LLAMACPP_DRAFTS.register("dflash")(LlamaCppDraft("dflash", "draft-dflash", "dflash", _llamacpp_refusal))
