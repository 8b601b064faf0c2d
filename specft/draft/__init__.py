"""Draft heads (registry) and the draft vocabulary."""

from specft.draft.eagle3 import Eagle3Config, Eagle3Draft
from specft.draft.vocab import DraftVocab, build_draft_vocab
from specft.registry import Registry

DRAFT_HEADS: Registry = Registry("draft head")
DRAFT_HEADS.register("eagle3")(Eagle3Draft)

__all__ = ["DRAFT_HEADS", "DraftVocab", "Eagle3Config", "Eagle3Draft", "build_draft_vocab"]
