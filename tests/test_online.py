"""trainer.features=online: the served target computes the features inside training."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import run_cli

# Tiny Qwen3 is float32; a float32 cache stores its features exactly.
COMMON = ["train", "model=tiny_qwen3", "quant=mxfp4", "data.num_samples=24", "trainer.max_steps=6",
          "trainer.micro_batch_size=2", "trainer.save_every=2"]


def _losses(run_dir: Path, split: str = "train") -> list[float]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["split"] == split]


def _weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "checkpoints" / "final" / "draft.safetensors"))


def test_online_steps_equal_cached_steps(tmp_path):
    # Online features are computed one sample per forward; a cache computed the same way
    # (cache.batch_size=1) holds the same bits. Padded batches of 8 move the last bits of
    # some features (losses then agree to ~1e-7, not to the last digit).
    run_cli([*COMMON, "cache.dtype=fp32", "cache.batch_size=1", f"run_dir={tmp_path / 'cached'}"], cwd=tmp_path)
    out = run_cli([*COMMON, "trainer.features=online", f"run_dir={tmp_path / 'online'}",
                   f"cache.root={tmp_path / 'no_cache'}"], cwd=tmp_path)
    assert "online features: " in out.stderr
    assert not (tmp_path / "no_cache").exists()  # nothing cached
    cached, online = _losses(tmp_path / "cached"), _losses(tmp_path / "online")
    assert len(online) == 6 and online == cached  # to the last digit
    assert _losses(tmp_path / "online", "val") == _losses(tmp_path / "cached", "val")
    a, b = _weights(tmp_path / "cached"), _weights(tmp_path / "online")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_two_ranks_online_with_a_partitioned_target_equal_the_cached_run(tmp_path):
    # ZeRO-3 partitions the served target over both ranks (each forward gathers it), each
    # rank regenerates half the answers and reads the other half's from their store.
    two = [*COMMON, "trainer.nproc=2", "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=8",
           "trainer.max_steps=4"]
    run_cli([*two, "cache.dtype=fp32", "cache.batch_size=1", f"run_dir={tmp_path / 'cached'}"], cwd=tmp_path)
    out = run_cli([*two, "trainer.features=online", "cache.sharding=zero3", f"run_dir={tmp_path / 'online'}"],
                  cwd=tmp_path)
    assert "cache.sharding=zero3" in out.stderr and "online features: 24 samples" in out.stderr
    assert _losses(tmp_path / "online") == _losses(tmp_path / "cached")
    assert _losses(tmp_path / "online", "val") == _losses(tmp_path / "cached", "val")


def test_killed_online_training_resumes_exactly(tmp_path):
    args = [*COMMON, "trainer.features=online", "trainer.max_steps=30"]
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), killed_dir.mkdir()
    run_cli([*args, f"run_dir={ref_dir / 'run'}"], cwd=ref_dir)

    proc = subprocess.Popen([sys.executable, "-m", "specft.cli", *args, f"run_dir={killed_dir / 'run'}"],
                            cwd=killed_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    latest = killed_dir / "run" / "checkpoints" / "latest"
    while not (latest.exists() and latest.read_text() >= "step-0000004") and proc.poll() is None:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed_dir / "run" / "checkpoints" / "final").exists(), "finished before the kill"

    out = run_cli([*args, f"run_dir={killed_dir / 'run'}"], cwd=killed_dir)
    assert "resumed from" in out.stderr
    assert _losses(killed_dir / "run") == _losses(ref_dir / "run")  # the same batches, step for step
    assert _losses(killed_dir / "run", "val") == _losses(ref_dir / "run", "val")


def test_new_answers_every_epoch(tmp_path):
    # 8 samples, 2 per step: steps 1-4 are epoch 0, steps 5-8 epoch 1.
    args = [*COMMON, "trainer.features=online", "data.num_samples=8", "trainer.max_steps=8",
            "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=8", "data.regenerate.temperature=1.0",
            "trainer.val_fraction=0"]
    run_cli([*args, f"run_dir={tmp_path / 'once'}"], cwd=tmp_path)
    out = run_cli([*args, "trainer.regenerate_every_epoch=true", f"run_dir={tmp_path / 'each'}"], cwd=tmp_path)
    assert "epoch 1, the target answers the 8 prompts again" in out.stderr
    assert "epoch 2" not in out.stderr
    stores = sorted((tmp_path / "each" / "online").glob("train-*/regenerated-r000.jsonl"))
    answers = [[json.loads(line)["messages"] for line in p.read_text().splitlines()] for p in stores]
    assert len(answers) == 2 and all(len(a) == 8 for a in answers) and answers[0] != answers[1]
    once, each = _losses(tmp_path / "once"), _losses(tmp_path / "each")
    assert each[:4] == once[:4]  # epoch 0: the usual answers
    assert each[4:] != once[4:]  # epoch 1: new ones


@pytest.mark.parametrize("override, field", [
    ("cache.dir=/tmp/somewhere", "cache.dir"),
    ("cache.dtype=fp8", "cache.dtype"),
    ("cache.batch_size=2", "cache.batch_size"),  # ignored without a word before
    ("cache.samples_per_shard=5", "cache.samples_per_shard"),
    ("trainer.mix_quant=bf16", "trainer.mix_quant"),
    ("cache.sharding=tp", "cache.sharding"),
])
def test_online_refuses_cache_only_options(tmp_path, override, field):
    proc = run_cli(["train", "model=tiny_qwen3", "trainer.features=online", override], cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {field}") and "trainer.features=online" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_new_answers_every_epoch_need_online_and_sampling(tmp_path):
    for extra, says in ((["trainer.features=cache"], "need the target in training: trainer.features=online"),
                        (["trainer.features=online", "data.regenerate.enabled=true"], "temperature > 0")):
        proc = run_cli(["train", "model=tiny_qwen3", "trainer.regenerate_every_epoch=true", *extra], cwd=tmp_path,
                       check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr
        assert lines[0].startswith("error: trainer.regenerate_every_epoch")
    assert list(tmp_path.iterdir()) == []


def test_the_config_lists_every_feature_source():
    from specft.commands.pipeline import FEATURES
    from specft.config import FEATURE_SOURCES

    assert sorted(FEATURE_SOURCES) == FEATURES.names  # validate.py checks the names without the stages
