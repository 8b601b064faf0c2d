"""The MTP head's serving layout: DeepSeek-V3's MTP layer after the target's last."""

from __future__ import annotations

import torch

from specft.common.errors import SpecftError
from specft.drafts.layouts import LAYOUTS, SafetensorsLayout, decoder_block


@LAYOUTS.register("mtp")
class MtpLayout(SafetensorsLayout):
    def config(self, meta: dict) -> dict:
        if meta.get("qk_norm"):
            raise SpecftError("export: the mtp layout's decoder layer (DeepSeek-V3) has no q/k norm; "
                              "train with draft.qk_norm=false to export it")
        return {"architectures": ["DeepseekV3ForCausalLM"], **decoder_block(meta), "num_hidden_layers":
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
