"""P-EAGLE (parallel drafting): the model (model.py), its decoding runner (runner.py) and
its serving layout (export.py), registered as architecture ``peagle``."""

import torch

from specft.drafts.arch import DraftArch, mask_token_options, register_draft
from specft.drafts.init import copy_layer_
from specft.drafts.layers import DraftHeadConfig
from specft.drafts.peagle import export  # noqa: F401  (registers the peagle layout)
from specft.drafts.peagle.model import PEagleDraft
from specft.drafts.peagle.runner import ParallelRunner


def _empty(c: DraftHeadConfig) -> PEagleDraft:
    return PEagleDraft(c, torch.zeros(c.target_vocab_size, c.hidden_size), torch.arange(c.draft_vocab_size))


register_draft("peagle", DraftArch(
    build=lambda c, head, vocab: PEagleDraft(c, head["embed_tokens"], vocab.draft_to_target),
    empty=_empty, layouts=("peagle",), runner=ParallelRunner, options=mask_token_options,
    # Each trained TTT step is one parallel slot; a slot it never trained is not drafted.
    max_draft_tokens=lambda draft: draft.ttt_steps,
    init_from_layer=lambda draft, layer: copy_layer_(draft.midlayer, layer, input_norm="hidden_norm")))

__all__ = ["PEagleDraft"]
