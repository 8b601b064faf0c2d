"""A DeepSeek-V3 style MTP module: the model (model.py) and its serving layout
(export.py), registered as architecture ``mtp``."""

import torch

from specft.common.errors import ConfigError
from specft.drafts.arch import DraftArch, register_draft
from specft.drafts.init import copy_layer_
from specft.drafts.layers import DraftHeadConfig
from specft.drafts.mtp import export  # noqa: F401  (registers the mtp layout)
from specft.drafts.mtp.model import MtpDraft


def _empty(c: DraftHeadConfig) -> MtpDraft:
    return MtpDraft(c, torch.zeros(c.target_vocab_size, c.hidden_size), torch.arange(c.draft_vocab_size),
                    torch.zeros(c.draft_vocab_size, c.hidden_size))


def _check(draft, model) -> None:
    """An MTP module shares the target's head and has one decoder layer."""
    if draft.hidden_size not in (None, model.hidden_size):
        raise ConfigError(f"draft.hidden_size: an mtp module shares the target's head, so its width is "
                          f"the target's ({model.hidden_size}); got {draft.hidden_size}")
    if draft.num_layers != 1:
        raise ConfigError(f"draft.num_layers: an mtp module has one decoder layer; allowed: 1, got {draft.num_layers}")


register_draft("mtp", DraftArch(
    build=lambda c, head, vocab: MtpDraft(c, head["embed_tokens"], vocab.draft_to_target, head["draft_rows"]),
    empty=_empty, layouts=("mtp",), check=_check,
    init_from_layer=lambda draft, layer: copy_layer_(draft.block, layer)))

__all__ = ["MtpDraft"]
