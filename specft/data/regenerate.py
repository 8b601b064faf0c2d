"""Regeneration: replace every assistant turn with the (quantized) target's own answer.

The draft must predict what the deployed target says, not what a dataset's author wrote,
so stage 1 can let the target answer its prompts first. Conversations are answered in
batches (left-padded, one `generate` call per assistant turn); each finished batch is
appended to ``regenerated-r<rank>.jsonl`` in the cache directory, so a killed run resumes
without answering anything twice. A rank answers only its own samples (i % world == rank);
the others stay None in its list.

data.regenerate.fraction answers only a seeded share of the conversations, and a data.mix
member with keep_text none of its own; the rest keep their fixed text (the dataset's
answers), which stage 1 then reads at teacher-forced speed: the mixes of issue 34's
data-per-CPU-hour study.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from specft.common.errors import SpecftError
from specft.common.progress import progress_bar
from specft.config import DataConfig, RegenerateConfig
from specft.data import kept_text_positions
from specft.data.answer_store import (
    append_store,
    conversation_digest,
    load_store,
    mark,
    reusable_answers,
    store_path,
)
from specft.data.records import Conversation, DataSummary
from specft.data.template import prompt_ids
from specft.engines import engine_for
from specft.engines.generate import generate_batch

log = logging.getLogger(__name__)


def answered_by_target(convs: list[Conversation], cfg: DataConfig) -> set[int]:
    """The conversations the target answers: all, or a seeded share
    data.regenerate.fraction of them, less those of keep_text mix members (the same set
    on every rank and every resume)."""
    rc, count = cfg.regenerate, len(convs)
    chosen = set(range(count))
    if rc.fraction is not None:
        order = torch.randperm(count, generator=torch.Generator().manual_seed(rc.seed + 15_485_863)).tolist()
        chosen = set(order[: round(count * rc.fraction)])
    return chosen - kept_text_positions(convs, cfg)


def read_all_answers(cache_dir: Path, convs: list[Conversation], world_size: int,
                     cfg: DataConfig) -> list[Conversation | None]:
    """Every slice's answered conversations (once every rank has finished), the fixed
    text where the target answers none, None where an answer was not stored: what a rank
    needs when it may read any sample (online training)."""
    done: dict[int, Conversation] = {}
    for rank in range(world_size):
        done.update(load_store(store_path(cache_dir, rank)))
    answered = answered_by_target(convs, cfg)
    return [done.get(i) if i in answered else convs[i] for i in range(len(convs))]


def _answer_conversations(model, tokenizer, convs: list[Conversation], cfg: DataConfig, seed: int,
                          summary: DataSummary, lockstep, answer) -> tuple[list[Conversation | None], int]:
    """Answer every assistant turn of ``convs`` in order, turn by turn across the batch,
    with ``answer`` (the answers engine's, specft/engines/). A conversation whose answer the
    engine cut short (None: a server's context ran out) is None: never stored as complete."""
    convs = [[dict(m) for m in c] for c in convs]
    cut: set[int] = set()
    new_tokens = 0
    slot = 0
    while True:
        rows = []  # (conversation number, message position) of each conversation's slot-th answer
        for n, c in enumerate(convs):
            positions = [j for j, m in enumerate(c) if m["role"] == "assistant"]
            if slot < len(positions) and n not in cut:
                rows.append((n, positions[slot]))
        if not rows:
            return [None if n in cut else c for n, c in enumerate(convs)], new_tokens
        prompts = [prompt_ids(tokenizer, convs[n][:j], cfg.thinking) for n, j in rows]
        lockstep.step(True)
        answers, capped = answer(model, tokenizer, prompts, seed + slot, lockstep.enabled)
        for (n, j), ans, cap in zip(rows, answers, capped):
            if ans is None:
                cut.add(n)
                continue
            convs[n][j]["content"] = tokenizer.decode(ans, skip_special_tokens=False).strip()
            new_tokens += len(ans)
            summary["regen_hit_max_new_tokens"] += int(cap)
        slot += 1


def regenerate(model, tokenizer, convs: list[Conversation], cfg: DataConfig, cache_dir: Path,
               rank: int = 0, world_size: int = 1, summary: DataSummary | None = None,
               writes: bool = True, lockstep=None, answer_key: str | None = None) -> list[Conversation | None]:
    """Answer this data slice's conversations (``rank`` of ``world_size`` slices); see
    CacheWriter for ``writes`` and ``lockstep``. With an ``answer_key`` (answer_store),
    answers stored under that key by other caches in ``cache_dir``'s parent are reused."""
    from specft.target_model.sharding import Lockstep

    # A server answers without the ranks' model: no forward for the ranks to keep in step.
    lockstep = lockstep if lockstep is not None and cfg.regenerate.engine == "specft" else Lockstep(False)
    try:
        return _regenerate(model, tokenizer, convs, cfg, cache_dir, rank, world_size,
                           summary if summary is not None else DataSummary(), writes, lockstep, answer_key)
    finally:  # out of work: keep joining the other ranks' generation until all are done
        eos = tokenizer.eos_token_id or 0
        lockstep.drain(lambda: generate_batch(model, tokenizer, [[eos]], _ONE_TOKEN, 0, synced=True))


_ONE_TOKEN = RegenerateConfig(max_new_tokens=1)


def _reuse(convs, pending: list[int], cache_dir: Path, key: str, tokenizer,
           summary: DataSummary) -> dict[int, Conversation]:
    """The pending conversations another cache under the same answer key has answered."""
    stored = reusable_answers(cache_dir, key)
    if not stored:
        return {}
    found = {}
    for i in pending:
        conv = stored.get(conversation_digest(convs[i]))
        if conv is not None:
            found[i] = conv
    if found:
        # Their token count, re-tokenized from the stored text (what stage 1 will read).
        tokens = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
                     for c in found.values() for m in c if m["role"] == "assistant" and m["content"])
        summary["regen_reused"] += len(found)
        summary["regen_reused_tokens"] += tokens
        log.info("regenerate: reusing %d answers (%d tokens) stored by caches next to %s",
                 len(found), tokens, cache_dir.name)
    return found


def _regenerate(model, tokenizer, convs, cfg: DataConfig, cache_dir: Path, rank: int, world_size: int,
                summary: DataSummary, writes: bool, lockstep, key: str | None) -> list[Conversation | None]:
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = store_path(cache_dir, rank)
    done = load_store(path)
    rc = cfg.regenerate
    answered = answered_by_target(convs, cfg)
    my_slice = range(rank, len(convs), world_size)
    mine = [i for i in my_slice if i in answered]
    kept = {i for i in my_slice if i not in answered}  # fraction, keep_text: fixed text stays
    pending = [i for i in mine if i not in done]
    if key is not None and cfg.regenerate.reuse:
        if writes:
            mark(cache_dir, key)
        # Only what is still pending is looked up: a resumed cache reads no other store.
        reused = _reuse(convs, pending, cache_dir, key, tokenizer, summary) if pending else {}
        if writes and reused:
            append_store(path, [{"index": i, "messages": c} for i, c in reused.items()])
        done.update(reused)
        pending = [i for i in pending if i not in reused]
    t0, tokens, cut = time.perf_counter(), 0, 0
    answer = engine_for("answers", rc.engine).answerer(rc) if pending else None
    with progress_bar(len(mine), f"regenerate r{rank}", "conv", initial=len(mine) - len(pending)) as bar:
        for start in range(0, len(pending), rc.batch_size):
            batch = pending[start: start + rc.batch_size]
            try:
                answered, n = _answer_conversations(model, tokenizer, [convs[i] for i in batch], cfg,
                                                    rc.seed + batch[0], summary, lockstep, answer)
            except SpecftError as err:  # a server gone, an answer cut: what is stored stays for the rerun
                raise SpecftError(f"{err} ({len(done)} of this slice's {len(mine)} answers are stored in {path}; "
                                  "a rerun resumes from them)") from None
            complete = {i: c for i, c in zip(batch, answered) if c is not None}
            cut += len(batch) - len(complete)
            if writes:
                append_store(path, [{"index": i, "messages": c} for i, c in complete.items()])
            done.update(complete)
            tokens += n
            bar.update(len(batch))
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - t0):.1f} tok/s", refresh=False)
    if pending:
        spent = time.perf_counter() - t0
        log.info("regenerate r%d: %d conversations, %d new tokens in %.1fs (%.1f tok/s)", rank, len(pending),
                 tokens, spent, tokens / spent if spent else 0.0)
        # Integers, so a Counter sums them over ranks; the manifest's data_summary keeps them.
        summary["regen_new_tokens"] += tokens
        summary["regen_ms"] += round(1000 * spent)
    if cut:
        summary["regen_cut_by_engine"] += cut
        raise SpecftError(f"data.regenerate: {cut} of {len(pending)} conversations got an answer cut short by "
                          f"the engine (it stopped before data.regenerate.max_new_tokens={rc.max_new_tokens} "
                          "tokens without a stop token: a server's context per request is full); none of them "
                          f"is stored, the other {len(done)} of this slice's {len(mine)} answers are, in {path}. "
                          "Give each server slot a context of at least data.max_seq_len + max_new_tokens and "
                          "rerun: it resumes")
    summary["regenerated"] += len(mine)
    if kept:
        summary["kept_fixed_text"] += len(kept)
    return [done[i] if i in done else convs[i] if i in kept else None for i in range(len(convs))]
