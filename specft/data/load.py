"""The run's conversations from its sources (one source, or data.mix's members), and
conversations to token ids with the assistant loss mask."""

from __future__ import annotations

import dataclasses
import logging
import random

from specft.common.errors import ConfigError, NoConversations, SpecftError
from specft.config import DataConfig
from specft.data.answer_store import conversation_digest
from specft.data.records import Conversation, DataSummary
from specft.data.select import select_conversations, with_system_prompt
from specft.data.sources import DATA_SOURCES, rewrite_answers
from specft.data.template import Sample, tokenize_conversation

log = logging.getLogger(__name__)


def load_conversations(cfg: DataConfig, summary: DataSummary | None = None) -> list[Conversation]:
    """The run's conversations in their fixed order (see select.py)."""
    summary = summary if summary is not None else DataSummary()
    if cfg.name == "mix":
        convs = _load_mix(cfg, summary)
    else:
        source = DATA_SOURCES.get(cfg.name, "data.name")
        convs = rewrite_answers(select_conversations(source(cfg, summary), cfg, summary), cfg)
    if not convs:
        raise NoConversations(f"data: no usable conversations from data.name={cfg.name} path={cfg.path} "
                              f"split={cfg.split}; {summary.line()}", summary)
    return [with_system_prompt(c, cfg.system_prompt) for c in convs]


# Fields a mix member may not set: they belong to the whole run.
_MIX_RUN_FIELDS = {"mix", "regenerate", "max_seq_len", "overlength", "thinking", "system_prompt"}


def mix_members(cfg: DataConfig) -> list[DataConfig]:
    """data.mix as full data configs: each member inherits the run's fields and overrides
    its own (name, path, num_samples, ...)."""
    if not cfg.mix:
        raise ConfigError("data.name=mix needs data.mix: a list of sources, e.g. "
                          "[{name: gsm8k, path: train.jsonl, num_samples: 200}, {name: sharegpt, ...}]")
    known = {f.name for f in dataclasses.fields(DataConfig)} - _MIX_RUN_FIELDS
    members = []
    for i, member in enumerate(cfg.mix):
        member = dict(member)
        bad = sorted(set(member) - known)
        if bad or member.get("name", "mix") == "mix":
            why = f"unknown or run-wide field {bad[0]!r}" if bad else "needs a source name (not mix)"
            raise ConfigError(f"data.mix[{i}]: {why}; a member sets: {', '.join(sorted(known))}")
        members.append(dataclasses.replace(cfg, mix=[], **member))
    return members


def check_data_files(cfg: DataConfig) -> None:
    """Every local data file the run will read exists and is a file (one line naming the
    field otherwise): checked before a command writes anything."""
    from specft.data.records import require_file
    from specft.data.sources import DATA_SOURCES

    members = mix_members(cfg) if cfg.name == "mix" else [cfg]
    for i, member in enumerate(members):
        if getattr(DATA_SOURCES.get(member.name, "data.name"), "reads_file", False):
            require_file(member.path, f"data.mix[{i}].path" if cfg.name == "mix" else "data.path")


def _member_conversations(member: DataConfig, summary: DataSummary) -> list[Conversation]:
    source = DATA_SOURCES.get(member.name, "data.mix.name")
    return rewrite_answers(select_conversations(source(member, summary), member, summary), member)


def _load_mix(cfg: DataConfig, summary: DataSummary) -> list[Conversation]:
    """Each member selected on its own (its split, dedup and cap), then joined and
    shuffled by the run's seed so batches hold every source."""
    convs: list[Conversation] = []
    for member in mix_members(cfg):
        part = _member_conversations(member, summary)
        summary[f"from_{member.name}"] += len(part)
        convs += part
    random.Random(cfg.seed).shuffle(convs)
    return convs


def kept_text_positions(convs: list[Conversation], cfg: DataConfig) -> set[int]:
    """Positions in ``convs`` (load_conversations(cfg)) of the conversations that come
    from data.mix members with keep_text: regeneration leaves their text as written. A
    member's conversations are found by their questions (a question that two members
    share keeps its text in both)."""
    members = [m for m in mix_members(cfg) if m.keep_text] if cfg.name == "mix" else []
    if not members:
        return set()
    kept = {conversation_digest(with_system_prompt(c, cfg.system_prompt))
            for m in members for c in _member_conversations(m, DataSummary())}
    return {i for i, c in enumerate(convs) if conversation_digest(c) in kept}


def tokenize_all(convs: list[Conversation | None], tokenizer, cfg: DataConfig,
                 summary: DataSummary) -> list[Sample | None]:
    """One Sample per conversation, or None where it was skipped (over-length with
    overlength=drop, or no assistant token left); positions are kept so that every rank
    agrees on sample indices."""
    samples: list[Sample | None] = []
    for conv in convs:
        if conv is None:
            samples.append(None)
            continue
        sample, truncated = tokenize_conversation(tokenizer, conv, cfg.max_seq_len, cfg.thinking)
        if truncated and cfg.overlength == "drop":
            summary.skip("overlength_dropped")
            sample = None
        elif sample is None:
            summary.skip("no_assistant_tokens" if not truncated else "overlength_no_answer_left")
        elif truncated:
            summary["truncated"] += 1
        samples.append(sample)
    summary["samples"] = sum(s is not None for s in samples)
    return samples


def load_samples(cfg: DataConfig, tokenizer, summary: DataSummary | None = None) -> list[Sample]:
    """Conversations straight to samples (no regeneration), skipped ones left out."""
    summary = summary if summary is not None else DataSummary()
    samples = [s for s in tokenize_all(load_conversations(cfg, summary), tokenizer, cfg, summary) if s]
    report(summary)
    if not samples:
        raise SpecftError(f"data: no usable samples from data.name={cfg.name}; {summary.line()}")
    return samples


def report(summary: DataSummary) -> None:
    (log.warning if summary.skipped else log.info)(summary.line())
