"""P-EAGLE's serving layout: vLLM's EAGLE-3 checkpoint plus ``mask_hidden`` (the mask
slots' fused feature vector, which vLLM passes through fc) and ``mask_token_id`` in the
config. vLLM drafts with it given ``speculative_config={"method": "eagle3",
"parallel_drafting": True, ...}`` (llama_eagle3.py / qwen3_eagle3.py load mask_hidden)."""

from __future__ import annotations

from specft.drafts.eagle3.export import Eagle3Layout
from specft.drafts.layouts import LAYOUTS


@LAYOUTS.register("peagle")
class PEagleLayout(Eagle3Layout):
    vllm_speculative = {"method": "eagle3", "parallel_drafting": True}

    def config(self, meta: dict) -> dict:
        return {**super().config(meta), "mask_token_id": meta["options"]["mask_token_id"],
                "parallel_draft_tokens": meta["max_draft_tokens"]}

