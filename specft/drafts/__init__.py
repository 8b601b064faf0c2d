"""Draft heads: one folder per architecture (eagle3/, mtp/, dflash/, peagle/; found by
pkgutil below, so a new folder needs no list edited), each registering itself in
DRAFT_ARCHS (arch.py) under the architecture string draft_config.json records; shared
layers (layers.py), the draft vocabulary (vocab.py) and draft QAT (qat.py).

A head's forward(input_ids, aux_hidden, final_hidden, steps) returns a DraftOutput
(logits and hidden states per TTT step); start_hidden / decode_step / logits /
attention_modules are the pieces decoding (specft/decoding/draft.py) runs."""

import importlib
import pkgutil

from specft.drafts.arch import DRAFT_ARCHS, DraftArch, register_draft
from specft.drafts.eagle3.model import Eagle3Draft
from specft.drafts.layers import DraftHeadConfig, DraftOutput
from specft.drafts.mtp.model import MtpDraft
from specft.drafts.vocab import DraftVocab, build_draft_vocab

# Every architecture folder registers itself on import: a new one needs no line here.
for _pkg in pkgutil.iter_modules(__path__):
    if _pkg.ispkg:
        importlib.import_module(f"{__name__}.{_pkg.name}")

__all__ = ["DRAFT_ARCHS", "DraftArch", "DraftHeadConfig", "DraftOutput", "DraftVocab", "Eagle3Draft", "MtpDraft",
           "build_draft_vocab", "register_draft"]
