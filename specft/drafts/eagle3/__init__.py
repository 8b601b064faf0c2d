"""EAGLE-3: the model (model.py) and its serving layouts (export.py), registered as
architecture ``eagle3``."""

import torch

from specft.drafts.arch import DraftArch, register_draft
from specft.drafts.eagle3 import export  # noqa: F401  (registers the eagle3 and speculators layouts)
from specft.drafts.eagle3.model import Eagle3Draft
from specft.drafts.init import copy_layer_
from specft.drafts.layers import DraftHeadConfig


def _empty(c: DraftHeadConfig) -> Eagle3Draft:
    return Eagle3Draft(c, torch.zeros(c.target_vocab_size, c.hidden_size), torch.arange(c.draft_vocab_size))


register_draft("eagle3", DraftArch(
    build=lambda c, head, vocab: Eagle3Draft(c, head["embed_tokens"], vocab.draft_to_target),
    empty=_empty, layouts=("eagle3", "speculators"),
    # The first layer's hidden_norm normalizes the target features, as the target's input norm does.
    init_from_layer=lambda draft, layer: copy_layer_(draft.midlayer, layer, input_norm="hidden_norm")))

__all__ = ["Eagle3Draft"]
