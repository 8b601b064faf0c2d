"""Conversations -> token ids + loss mask, using the tokenizer's own chat template.

The mask marks exactly the tokens of assistant turns: what the model generates after the
template's generation prompt, through its end-of-turn token. Assistant spans are found by
rendering the conversation prefix with a generation prompt and the conversation up to and
including the turn: the text between the two is the assistant's. Templates that rewrite
earlier turns (Qwen3 drops the reasoning of turns before the last question) are handled
by locating the turn's content in the full rendering, plus the same end-of-turn text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # uint8 [T], 1 on assistant tokens


def render(tokenizer, messages, add_generation_prompt: bool, thinking: bool | None = None) -> str:
    extra = {} if thinking is None else {"enable_thinking": thinking}
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **extra)


def _turn_suffix(through: str, content: str) -> str:
    """The template's text after the turn's content (its end-of-turn marker)."""
    at = through.rfind(content)
    return through[at + len(content):] if at >= 0 else ""


def assistant_char_spans(tokenizer, messages, thinking: bool | None = None) -> tuple[str, list[tuple[int, int]]]:
    full = render(tokenizer, messages, False, thinking)
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], True, thinking) if i else ""
        through = render(tokenizer, messages[: i + 1], False, thinking)
        if full.startswith(through) and through.startswith(before):
            spans.append((len(before), len(through)))
            continue
        # The visible answer: templates that drop reasoning keep what follows </think>.
        visible = msg["content"].split("</think>")[-1].lstrip()
        start = full.find(visible, spans[-1][1] if spans else 0)
        if start >= 0:
            end = start + len(visible)
            suffix = _turn_suffix(through, visible)
            if suffix and full.startswith(suffix, end):
                end += len(suffix)
            spans.append((start, end))
    return full, spans


def tokenize_conversation(tokenizer, messages, max_len: int,
                          thinking: bool | None = None) -> tuple[Sample | None, bool]:
    """(sample, truncated): token ids and assistant mask cut to ``max_len``; the sample is
    None when no assistant token survives (nothing to learn from)."""
    text, spans = assistant_char_spans(tokenizer, messages, thinking)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    truncated = len(enc["input_ids"]) > max_len
    ids = enc["input_ids"][:max_len]
    mask = [int(any(a <= start < b for a, b in spans)) for start, _end in enc["offset_mapping"][:max_len]]
    if not any(mask):
        return None, truncated
    return Sample(torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.uint8)), truncated


def prompt_ids(tokenizer, messages, thinking: bool | None = None) -> list[int]:
    """Token ids of ``messages`` followed by the generation prompt of the next assistant turn."""
    text = render(tokenizer, messages, True, thinking)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
