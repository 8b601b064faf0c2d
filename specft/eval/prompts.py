"""The prompts `specft eval` decodes: each conversation up to its first assistant turn."""

from __future__ import annotations

import dataclasses
import logging

from specft.config import DataConfig, RootConfig

log = logging.getLogger(__name__)


def eval_prompt_data(data: DataConfig, num_prompts: int) -> DataConfig:
    """The data config `specft eval` reads prompts with: answers are not read (open
    slots allowed, no answer-length filter), so no prompt is left out for its answer."""
    return dataclasses.replace(data, num_samples=num_prompts, min_response_chars=0,
                               regenerate=dataclasses.replace(data.regenerate, enabled=True))


def load_prompts(cfg: RootConfig, tokenizer) -> tuple[list[list[int]], dict[str, int]]:
    """Each conversation up to its first assistant turn, with the generation prompt; and
    the records left out, by reason (answers are not read, so none is left out for its
    answer: see eval_prompt_data)."""
    from specft.data import DataSummary, load_conversations
    from specft.data.template import prompt_ids

    summary = DataSummary()
    data = eval_prompt_data(cfg.data, cfg.eval.num_prompts)
    room = max(cfg.data.max_seq_len - cfg.eval.max_new_tokens, 1)  # keep the prompt's end
    prompts = []
    for conv in load_conversations(data, summary):
        first = next(i for i, m in enumerate(conv) if m["role"] == "assistant")
        prompts.append(prompt_ids(tokenizer, conv[:first], cfg.data.thinking)[-room:])
    left_out = {**summary.skipped, **{k: summary[k] for k in ("other_split", "over_cap") if summary[k]}}
    log.info("eval: %d prompts from %d records%s", len(prompts), summary["records"],
             "; left out: " + ", ".join(f"{v} {k}" for k, v in left_out.items()) if left_out else "")
    return prompts, left_out
