"""Which conversations a run uses: checked, deduplicated, assigned to train or validation
by a seeded hash, shuffled by seed, capped at data.num_samples.

The split hashes each conversation's text with the seed, so a conversation keeps its side
when the source grows or num_samples changes: caches for `split=train` and eval prompts
for `split=validation` never overlap.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable

from specft.config import DataConfig
from specft.data.records import Conversation, DataSummary, check_conversation, conversation_key


def is_validation(key: str, seed: int, fraction: float) -> bool:
    digest = hashlib.sha256(f"{seed}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def select_conversations(raw: Iterable[Conversation | str], cfg: DataConfig,
                         summary: DataSummary) -> list[Conversation]:
    allow_open = cfg.regenerate.enabled
    seen: set[str] = set()
    kept = []
    for conv in raw:
        summary["records"] += 1
        if isinstance(conv, str):
            summary.skip(conv)
            continue
        reason = check_conversation(conv, cfg, allow_open)
        if reason:
            summary.skip(reason)
            continue
        conv = [{"role": m["role"], "content": m["content"]} for m in conv]
        key = conversation_key(conv)
        if cfg.dedup and key in seen:
            summary.skip("duplicate")
            continue
        seen.add(key)
        if cfg.split != "all" and is_validation(key, cfg.seed, cfg.val_fraction) != (cfg.split == "validation"):
            summary["other_split"] += 1
            continue
        kept.append(conv)
    random.Random(cfg.seed).shuffle(kept)
    if len(kept) > cfg.num_samples:
        summary["over_cap"] += len(kept) - cfg.num_samples
    return kept[: cfg.num_samples]


def with_system_prompt(conv: Conversation, system_prompt: str | None) -> Conversation:
    if system_prompt and conv[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *conv]
    return conv
