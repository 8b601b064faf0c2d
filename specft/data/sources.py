"""Data sources: each turns a data config into conversations (lists of role/content)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from specft.config import DataConfig
from specft.errors import SpecftError
from specft.registry import Registry

Conversation = list[dict]
DATA_SOURCES: Registry = Registry("data source")

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


def _require_file(path: str | None) -> Path:
    p = Path(path or "").expanduser()
    if not p.is_file():
        raise SpecftError(f"data.path: no such file: {path}")
    return p


def _jsonl_records(path: Path, stats: dict) -> Iterator[dict]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                stats["bad_json"] = stats.get("bad_json", 0) + 1


@DATA_SOURCES.register("synthetic")
def synthetic_source(cfg: DataConfig, stats: dict) -> Iterator[Conversation]:
    from specft.data.synthetic import synthetic_conversations

    yield from synthetic_conversations(cfg.num_samples, seed=cfg.seed)


@DATA_SOURCES.register("jsonl")
def jsonl_source(cfg: DataConfig, stats: dict) -> Iterator[Conversation]:
    for rec in _jsonl_records(_require_file(cfg.path), stats):
        if isinstance(rec.get("messages"), list):
            yield rec["messages"]
        elif "prompt" in rec and "response" in rec:
            yield [{"role": "user", "content": rec["prompt"]},
                   {"role": "assistant", "content": rec["response"]}]
        else:
            stats["unknown_record"] = stats.get("unknown_record", 0) + 1


@DATA_SOURCES.register("gsm8k")
def gsm8k_source(cfg: DataConfig, stats: dict) -> Iterator[Conversation]:
    for rec in _jsonl_records(_require_file(cfg.path), stats):
        if "question" in rec and "answer" in rec:
            yield [{"role": "user", "content": rec["question"]},
                   {"role": "assistant", "content": rec["answer"]}]
        else:
            stats["unknown_record"] = stats.get("unknown_record", 0) + 1


@DATA_SOURCES.register("sharegpt")
def sharegpt_source(cfg: DataConfig, stats: dict) -> Iterator[Conversation]:
    path = _require_file(cfg.path)
    try:
        records = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as err:
        raise SpecftError(f"data.path: {path} is not valid JSON ({err})") from None
    for rec in records:
        turns = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(turns, list):
            stats["unknown_record"] = stats.get("unknown_record", 0) + 1
            continue
        conv = []
        for t in turns:
            role = _SHAREGPT_ROLES.get(str(t.get("from", "")).lower())
            if role is None or not isinstance(t.get("value"), str):
                conv = None
                break
            conv.append({"role": role, "content": t["value"]})
        if conv is None:
            stats["bad_role"] = stats.get("bad_role", 0) + 1
            continue
        yield conv
