"""Data: sources -> conversations -> token ids + assistant loss mask."""

from __future__ import annotations

import logging
import random

from specft.config import DataConfig
from specft.data.sources import DATA_SOURCES
from specft.data.template import Sample, tokenize_conversation

log = logging.getLogger(__name__)


def _valid(conv) -> bool:
    return (isinstance(conv, list) and conv
            and all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
                    for m in conv)
            and any(m["role"] == "assistant" for m in conv))


def load_samples(cfg: DataConfig, tokenizer) -> list[Sample]:
    """The selected samples in a fixed order: shuffled by ``cfg.seed``, then the first
    ``cfg.num_samples`` that tokenize to at least one assistant token."""
    stats: dict[str, int] = {}
    convs = list(DATA_SOURCES.get(cfg.name, "data.name")(cfg, stats))
    random.Random(cfg.seed).shuffle(convs)
    samples = []
    for conv in convs:
        if len(samples) >= cfg.num_samples:
            break
        if not _valid(conv):
            stats["invalid_conversation"] = stats.get("invalid_conversation", 0) + 1
            continue
        if cfg.system_prompt and conv[0]["role"] != "system":
            conv = [{"role": "system", "content": cfg.system_prompt}, *conv]
        sample = tokenize_conversation(tokenizer, conv, cfg.max_seq_len)
        if sample is None:
            stats["no_assistant_tokens"] = stats.get("no_assistant_tokens", 0) + 1
            continue
        samples.append(sample)
    if stats:
        log.warning("data: skipped %s", ", ".join(f"{v} {k}" for k, v in sorted(stats.items())))
    if not samples:
        from specft.errors import SpecftError

        raise SpecftError(f"data: no usable samples from data.name={cfg.name} path={cfg.path}")
    return samples


__all__ = ["DATA_SOURCES", "Sample", "load_samples", "tokenize_conversation"]
