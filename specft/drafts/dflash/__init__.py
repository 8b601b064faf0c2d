"""DFlash (block drafting): the model (model.py), its decoding runner (runner.py) and its
serving layout (export.py), registered as architecture ``dflash``."""

import torch

from specft.drafts.arch import DraftArch, mask_token_options, register_draft
from specft.drafts.dflash import export  # noqa: F401  (registers the dflash layout)
from specft.drafts.dflash.model import DFlashDraft
from specft.drafts.dflash.runner import BlockRunner
from specft.drafts.init import copy_layer_
from specft.drafts.layers import DraftHeadConfig


def _empty(c: DraftHeadConfig) -> DFlashDraft:
    return DFlashDraft(c, torch.zeros(c.target_vocab_size, c.hidden_size), torch.arange(c.draft_vocab_size))


register_draft("dflash", DraftArch(
    build=lambda c, head, vocab: DFlashDraft(c, head["embed_tokens"], vocab.draft_to_target),
    empty=_empty, layouts=("dflash",), runner=BlockRunner, options=mask_token_options,
    # A block has one mask slot per trained TTT step; a longer block was never trained.
    max_draft_tokens=lambda draft: draft.ttt_steps,
    feature_layers=None,  # fc reads as many target layers as model.aux_layer_ids names
    init_from_layer=lambda draft, layer: copy_layer_(draft.layers[0], layer)))

__all__ = ["DFlashDraft"]
