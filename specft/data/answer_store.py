"""Where regenerated answers are kept, and which other caches' answers a new one may reuse.

Each cache directory keeps its target's answers in ``regenerated-r<rank>.jsonl`` (one
line per finished conversation, so a killed run resumes). A cache for more or other
samples of the same data (a larger learning-curve budget, a run with more samples) asks
the same target the same questions again; the answers already stored next to it, in the
same cache.root, are reused instead of regenerated, when they were made under the same
*answer key*: the target (checkpoint, model, quant, tokenizer) and the generation
settings, but not which conversations were selected. A conversation is matched by its
content with the assistant turns blanked out (the system and user turns, in order), so
the same question from a differently selected or ordered set is found.

Reused answers are as much the target's own as regenerated ones: regenerating also
depends on which conversations share a padded batch (float32 padding effects flip a rare
greedy token), and no run fixes that either.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from specft.data.records import Conversation
from specft.provenance import answer_key

log = logging.getLogger(__name__)

KEY_FILE = "answer_key.json"
STORE_GLOB = "regenerated-r*.jsonl"


def store_path(cache_dir: Path, rank: int) -> Path:
    return cache_dir / f"regenerated-r{rank:03d}.jsonl"


def load_store(path: Path) -> dict[int, Conversation]:
    """Finished conversations by index; a line cut short by a kill is ignored (it is redone)."""
    done = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                messages = rec["messages"]
                if _is_conversation(messages):
                    done[int(rec["index"])] = messages
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError):
                continue
    return done


def _is_conversation(messages) -> bool:
    """What regeneration stores: turns with a string role and content (a line another
    tool or a hand edit wrote otherwise is redone, not read)."""
    return isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)


def append_store(path: Path, records: Iterable[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def conversation_digest(conv: Conversation) -> str:
    """The conversation's questions: roles in order, every non-assistant turn's text."""
    shape = [[m["role"], None if m["role"] == "assistant" else m["content"]] for m in conv]
    return hashlib.sha256(json.dumps(shape, ensure_ascii=False).encode()).hexdigest()


def mark(cache_dir: Path, key: str) -> None:
    """Name this directory's answers by their key, so later caches can find them before
    (or without) a manifest: a killed run's answers are reusable too."""
    path = cache_dir / KEY_FILE
    if not path.exists():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"answer_key": key}) + "\n", encoding="utf-8")
        os.replace(tmp, path)


def _key_of(directory: Path) -> str | None:
    """A sibling cache's answer key: its mark, or (caches made before marks) its manifest."""
    for name, read in ((KEY_FILE, lambda d: d["answer_key"]), ("manifest.json", lambda d: answer_key(d["provenance"]))):
        path = directory / name
        if path.exists():
            try:
                return read(json.loads(path.read_text(encoding="utf-8")))
            except (json.JSONDecodeError, KeyError, TypeError, OSError):
                return None
    return None


def reusable_answers(cache_dir: Path, key: str) -> dict[str, Conversation]:
    """Answers stored by the other cache directories next to ``cache_dir`` under the same
    answer key, by conversation digest."""
    found: dict[str, Conversation] = {}
    parent = cache_dir.parent
    if not parent.is_dir():
        return found
    for sibling in sorted(p for p in parent.iterdir() if p.is_dir() and p != cache_dir):
        if not any(sibling.glob(STORE_GLOB)) or _key_of(sibling) != key:
            continue
        for path in sorted(sibling.glob(STORE_GLOB)):
            for conv in load_store(path).values():
                found.setdefault(conversation_digest(conv), conv)
    return found
