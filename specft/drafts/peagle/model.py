"""The P-EAGLE draft head: an EAGLE-3 head that drafts k tokens in one forward.

Its weights are EAGLE-3's plus ``mask_hidden``, a learned vector in the target's fused
feature space (num_aux_layers x target hidden). Step 0 at position p is EAGLE-3's (token
x[p+1], fc of the target's features at p). Every later step j reads the same two inputs,
whatever came before it: the embedding of ``mask_token_id`` and fc(mask_hidden). Its output
is independent of the tokens drafted at earlier steps, which reach it only through
attention to their keys, so all k steps run as one forward (vLLM's parallel drafting
appends these k-1 mask slots after the bonus token). Training unrolls the steps exactly as
EAGLE-3's training-time test does (same positions, same attention), with these inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from specft.drafts.eagle3.model import Eagle3Draft
from specft.drafts.layers import DraftHeadConfig


class PEagleDraft(Eagle3Draft):
    architecture = "peagle"  # draft_config.json's architecture: the registry key

    def __init__(self, c: DraftHeadConfig, embed_tokens: torch.Tensor, draft_to_target: torch.Tensor):
        super().__init__(c, embed_tokens, draft_to_target)
        # Unit scale, as the target features it stands in for enter the same fc and norm.
        self.mask_hidden = nn.Parameter(torch.randn(self.fc.in_features))
        self.mask_token_id = int(c.options["mask_token_id"])

    def mask_inputs(self, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token embedding, hidden input) of ``length`` mask slots per row."""
        ids = torch.full((batch, length), self.mask_token_id, dtype=torch.long, device=self.mask_hidden.device)
        return self.embed_tokens(ids), self.start_hidden(self.mask_hidden.expand(batch, length, -1), None)

    def step_inputs(self, j: int, input_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if j == 0:
            return super().step_inputs(j, input_ids, hidden)
        return self.mask_inputs(*input_ids.shape)
