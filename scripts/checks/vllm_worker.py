"""Runs inside vLLM's own virtual environment (it imports vllm and nothing of specft):
greedy decoding of given prompt token ids with the target alone and with an EAGLE-3
draft export at each k, writing what vLLM counted as JSON.

    VLLM_PYTHON scripts/checks/vllm_worker.py REQUEST.json RESULT.json

REQUEST: {"target": dir, "draft": export dir or null (speculators auto-detection when
"auto_detect"), "prompts": [[ids]], "ks": [3, 5], "max_new_tokens": 64, "dtype":
"float32", "target_alone": true, "auto_detect": false, "max_num_seqs": 1, "speculative":
{"method": "eagle3"} (the export layout's own settings)}. Called by check_vllm.py.
"""

from __future__ import annotations

import json
import os
import sys
import time

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _counts(llm) -> dict:
    """vLLM's speculative-decoding counters (they accumulate over the engine's life)."""
    out = {"per_position": []}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            out[metric.name.removeprefix("vllm:spec_decode_")] = int(metric.value)
        elif metric.name == PER_POSITION:
            out["per_position"] = [int(v) for v in metric.values]
    return out


def _generate(llm, prompts, max_new_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return [list(r.outputs[0].token_ids) for r in results], seconds


def _engine(request: dict, k: int | None):
    from vllm import LLM

    common = {"dtype": request["dtype"], "max_model_len": request.get("max_model_len", 2048),
              "enforce_eager": True, "seed": 0, "disable_log_stats": False,
              "max_num_seqs": request.get("max_num_seqs", 16)}
    if k is None:
        return LLM(model=request["target"], **common)
    if request.get("auto_detect"):  # a speculators export names its verifier itself
        return LLM(model=request["draft"], **common)
    speculative = {**request.get("speculative", {"method": "eagle3"}), "model": request["draft"],
                   "num_speculative_tokens": k}
    return LLM(model=request["target"], speculative_config=speculative, **common)


def _run(request: dict, k: int | None) -> dict:
    import gc

    llm = _engine(request, k)
    _generate(llm, request["prompts"][:1], 4)  # warm-up, untimed
    before = _counts(llm) if k is not None else None
    tokens, seconds = _generate(llm, request["prompts"], request["max_new_tokens"])
    out = {"k": k or 0, "tokens": tokens, "seconds": seconds,
           "generated": sum(len(t) for t in tokens)}
    if k is not None:  # the counters accumulate: take the timed run's share
        after = _counts(llm)
        out.update({name: after[name] - before.get(name, 0) for name in after if name != "per_position"})
        out["per_position"] = [a - b for a, b in zip(after["per_position"],
                                                     before["per_position"] or [0] * len(after["per_position"]))]
    del llm
    gc.collect()
    return out


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    runs = ([None] if request.get("target_alone", True) else []) + list(request["ks"])
    results = [_run(request, k) for k in runs]
    with open(sys.argv[2], "w") as f:
        json.dump({"vllm_version": __import__("vllm").__version__, "runs": results}, f)


if __name__ == "__main__":  # vLLM spawns workers: they must not rerun this
    main()
