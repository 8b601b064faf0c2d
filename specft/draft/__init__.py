"""Draft heads (registry) and the draft vocabulary.

A head builder takes (architecture config, target head tensors {embed_tokens: the whole
embedding, draft_rows: the lm_head rows of the draft vocabulary}, draft vocabulary) and
returns a module whose forward(input_ids, aux_hidden, final_hidden, steps) returns a
DraftOutput (logits and hidden states per TTT step)."""

from specft.draft.eagle3 import DraftOutput, Eagle3Config, Eagle3Draft
from specft.draft.mtp import MtpDraft
from specft.draft.vocab import DraftVocab, build_draft_vocab
from specft.registry import Registry

DRAFT_HEADS: Registry = Registry("draft head")


@DRAFT_HEADS.register("eagle3")
def build_eagle3(c: Eagle3Config, head: dict, vocab: DraftVocab) -> Eagle3Draft:
    return Eagle3Draft(c, head["embed_tokens"], vocab.draft_to_target)


@DRAFT_HEADS.register("mtp")
def build_mtp(c: Eagle3Config, head: dict, vocab: DraftVocab) -> MtpDraft:
    return MtpDraft(c, head["embed_tokens"], vocab.draft_to_target, head["draft_rows"])


__all__ = ["DRAFT_HEADS", "DraftOutput", "DraftVocab", "Eagle3Config", "Eagle3Draft", "MtpDraft",
           "build_draft_vocab"]
