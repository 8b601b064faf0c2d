"""P-EAGLE (parallel drafting): the model (model.py), its decoding runner (runner.py) and
its serving layout (export.py), registered as architecture ``peagle``."""

import torch

from specft.drafts.arch import DraftArch, register_draft
from specft.drafts.init import copy_layer_
from specft.drafts.layers import DraftHeadConfig
from specft.drafts.peagle import export  # noqa: F401  (registers the peagle layout)
from specft.drafts.peagle.model import PEagleDraft
from specft.drafts.peagle.runner import ParallelRunner
from specft.errors import ConfigError

OPTIONS = ("mask_token_id",)


def _options(draft, model) -> dict:
    """mask_token_id: the token the mask slots embed (null: the target vocabulary's last
    id); its embedding is the target's, frozen, so any id serves and mask_hidden learns."""
    unknown = sorted(set(draft.options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"draft.options: a peagle draft takes {', '.join(OPTIONS)}; got {unknown}")
    mask = draft.options.get("mask_token_id")
    mask = model.vocab_size - 1 if mask is None else mask
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < model.vocab_size:
        raise ConfigError(f"draft.options.mask_token_id: a token id of the target, 0..{model.vocab_size - 1}; "
                          f"got {mask!r}")
    return {"mask_token_id": mask}


def _empty(c: DraftHeadConfig) -> PEagleDraft:
    return PEagleDraft(c, torch.zeros(c.target_vocab_size, c.hidden_size), torch.arange(c.draft_vocab_size))


register_draft("peagle", DraftArch(
    build=lambda c, head, vocab: PEagleDraft(c, head["embed_tokens"], vocab.draft_to_target),
    empty=_empty, layouts=("peagle",), runner=ParallelRunner, options=_options,
    # Each trained TTT step is one parallel slot; a slot it never trained is not drafted.
    max_draft_tokens=lambda draft: draft.ttt_steps,
    init_from_layer=lambda draft, layer: copy_layer_(draft.midlayer, layer, input_norm="hidden_norm")))

__all__ = ["PEagleDraft"]
