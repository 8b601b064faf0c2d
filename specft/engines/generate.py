"""specft's own engine for the target's answers (data.regenerate.engine=specft): batched
generation over the loaded target with the decode loop `specft eval` measures, or
transformers' ``generate`` where every forward is a collective (ZeRO-3)."""

from __future__ import annotations

import torch

from specft.config import RegenerateConfig
from specft.target_model.loader import left_pad, stop_token_ids


@torch.no_grad()
def generate_batch(model, tokenizer, prompts: list[list[int]], rc: RegenerateConfig,
                   seed: int, synced: bool = False) -> tuple[list[list[int]], list[bool]]:
    """Batched generation; returns each row's new tokens up to (not including) its first
    stop token, and whether the row hit max_new_tokens.

    Runs specft's decode loop (the one `specft eval` measures: a KV cache written in place,
    finished rows dropped, no head over the prompt). ``synced`` (ZeRO-3, where every
    forward is a collective) keeps transformers' ``generate``, which steps until every
    rank's batch is done."""
    stops = stop_token_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = (_generate_synced(model, prompts, rc, seed, stops, pad) if synced
            else _generate_engine(model, prompts, rc, seed, stops, pad))
    answers, capped = [], []
    for row in rows:
        cut = next((j for j, t in enumerate(row) if t in stops), None)
        answers.append(row[:cut] if cut is not None else row)
        capped.append(cut is None)
    return answers, capped


def _generate_engine(model, prompts, rc: RegenerateConfig, seed: int, stops: set[int], pad: int):
    from specft.decoding import SamplingConfig, SpecDecoder

    sampling = SamplingConfig(rc.temperature, rc.top_p, rc.top_k)
    return SpecDecoder(model, None, None, stops, pad).generate(prompts, 0, rc.max_new_tokens, sampling,
                                                                seed=seed).tokens


def _generate_synced(model, prompts, rc: RegenerateConfig, seed: int, stops: set[int], pad: int):
    ids, attn = left_pad(prompts, pad)
    sample = rc.temperature > 0
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=rc.max_new_tokens,
                         do_sample=sample, temperature=rc.temperature if sample else None,
                         top_p=rc.top_p if sample else None, top_k=rc.top_k if sample else None,
                         eos_token_id=sorted(stops), pad_token_id=pad, synced_gpus=True)
    return out[:, ids.shape[1]:].tolist()
