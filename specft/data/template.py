"""Conversations -> token ids + loss mask, using the tokenizer's own chat template.

The mask marks exactly the tokens of assistant turns (their content and end-of-turn
token). Assistant spans are found by rendering the conversation prefix with a generation
prompt and the conversation up to and including the turn: the text between the two is
the assistant's, and tokens whose characters start inside it are masked in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # uint8 [T], 1 on assistant tokens


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages) -> tuple[str, list[tuple[int, int]]]:
    full = _render(tokenizer, messages, False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        through = _render(tokenizer, messages[: i + 1], False)
        if full.startswith(through) and through.startswith(before):
            spans.append((len(before), len(through)))
        else:  # template rewrites earlier turns (e.g. drops reasoning): locate the content
            start = full.find(msg["content"], spans[-1][1] if spans else 0)
            if start >= 0:
                spans.append((start, start + len(msg["content"])))
    return full, spans


def tokenize_conversation(tokenizer, messages, max_len: int) -> Sample | None:
    """Token ids and assistant mask, truncated to ``max_len``; None when no assistant
    token survives (nothing to learn from)."""
    text, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:max_len]
    mask = [0] * len(ids)
    for j, (start, _end) in enumerate(enc["offset_mapping"][:max_len]):
        mask[j] = int(any(a <= start < b for a, b in spans))
    if not any(mask):
        return None
    return Sample(torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.uint8))
