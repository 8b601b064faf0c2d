"""Mistakes a user makes, one case each: exit code 2 (130 for Ctrl-C), one line naming
what is at fault, no traceback, and every file that existed before byte-identical after."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from test_export import _checkpoint

from specft.cache.integrity import file_record
from specft.common.rundir import resume_conflicts
from specft.data import DataSummary, load_conversations

from conftest import run_cli
from helpers import root_cfg

RUN = "runs/tiny_qwen3-mxfp4-eagle3-kl"


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(proc, *needles: str, code: int = 2) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    # Log lines ([specft ...], DeepSpeed's banner) and progress bars are not the message.
    lines = [ln for ln in proc.stderr.strip().splitlines()
             if ln.strip() and not ln.startswith("[") and "it/s]" not in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _run_unchanged(tmp_path, args, *needles, code=2):
    before = _tree(tmp_path)
    line = _refused(run_cli(args, cwd=tmp_path, check=False), *needles, code=code)
    assert _tree(tmp_path) == before
    return line


def _fake_trained_run(tmp_path, *overrides) -> Path:
    """A run dir as training leaves it: its config.yaml and a checkpoint."""
    run_dir = tmp_path / RUN
    cfg = OmegaConf.structured(root_cfg("model=tiny_qwen3", *overrides, run_dir=run_dir))
    (run_dir / "checkpoints" / "step-0000010").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-0000010" / "draft.safetensors").write_bytes(b"weights")
    (run_dir / "checkpoints" / "latest").write_text("step-0000010")
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return run_dir


# -- config values and data files ----------------------------------------------------------

def test_readme_loss_mixture_override_composes(tmp_path):
    proc = run_cli(["plan", "model=tiny_qwen3", "loss.terms={kl: 1.0, hidden: 0.1}"], cwd=tmp_path)
    assert proc.returncode == 0 and list(tmp_path.iterdir()) == []
    _run_unchanged(tmp_path, ["train", "model=tiny_qwen3", "loss.terms={kl: 1.0, bogus: 0.1}"],
                   "loss.terms", "bogus", "allowed: ce, hidden, kl, lk, tv")


def test_duplicate_aux_layers_are_refused(tmp_path):
    _run_unchanged(tmp_path, ["train", "model=tiny_qwen3", "model.aux_layer_ids=[1,1,3]"],
                   "model.aux_layer_ids", "each layer once")


def test_data_path_naming_a_directory_says_so(tmp_path):
    (tmp_path / "data").mkdir()
    _run_unchanged(tmp_path, ["train", "model=tiny_qwen3", "data=jsonl", f"data.path={tmp_path / 'data'}"],
                   "data.path", "is a directory")


def test_missing_mix_member_file_is_named_before_anything_is_written(tmp_path):
    _run_unchanged(tmp_path, ["cache", "model=tiny_qwen3", "data=mix",
                              "data.mix=[{name: synthetic}, {name: gsm8k, path: nowhere.jsonl}]"],
                   "data.mix[1].path", "nowhere.jsonl")


def test_a_utf8_bom_costs_no_record(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                     {"role": "assistant", "content": f"a{i}"}]}) for i in range(3)]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(rows).encode())
    cfg = root_cfg("model=tiny_qwen3", "data=jsonl", f"data.path={path}", "data.num_samples=10")
    summary = DataSummary()
    assert len(load_conversations(cfg.data, summary)) == 3 and not summary.skipped


# -- a refused command leaves a finished run as it was ----------------------------------

def test_failed_train_leaves_a_finished_runs_config_alone(tmp_path):
    _fake_trained_run(tmp_path)
    _run_unchanged(tmp_path, ["train", "model=tiny_qwen3", "data=jsonl", "data.path=missing.jsonl"],
                   "data.path", "missing.jsonl")


def test_resuming_with_settings_that_change_the_draft_is_refused(tmp_path):
    _fake_trained_run(tmp_path, "draft.ttt_steps=7")
    _run_unchanged(tmp_path, ["train", "model=tiny_qwen3", "draft.ttt_steps=5"],
                   "trainer.resume", "draft.ttt_steps", "7", "5")


def test_resume_may_change_only_where_and_how_long():
    stored = OmegaConf.to_container(OmegaConf.structured(root_cfg("model=tiny_qwen3")))
    longer = OmegaConf.to_container(OmegaConf.structured(root_cfg(
        "model=tiny_qwen3", "trainer.max_steps=5000", "trainer.save_every=7", "logger=wandb")))
    assert resume_conflicts(stored, longer) == []
    for override, key in (("loss=lk", "loss.name"), ("draft.vocab_size=64", "draft.vocab_size"),
                          ("quant=fp8", "quant.name"), ("data.num_samples=9", "data.num_samples"),
                          ("trainer.lr=0.5", "trainer.lr")):
        other = OmegaConf.to_container(OmegaConf.structured(root_cfg("model=tiny_qwen3", override)))
        assert any(c.startswith(key + ":") for c in resume_conflicts(stored, other)), override


# -- places that cannot be written ------------------------------------------------------

def test_specft_home_that_cannot_be_a_directory(tmp_path):
    blocker = tmp_path / "home"
    blocker.write_text("a file")
    before = _tree(tmp_path)
    env = {**os.environ, "SPECFT_HOME": str(blocker / "sub")}
    proc = subprocess.run([sys.executable, "-m", "specft.cli", "train", "model=tiny_qwen3", "model.name=tiny_other"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=3600)
    _refused(proc, "SPECFT_HOME", "is a file")
    assert _tree(tmp_path) == before


def test_cache_root_under_a_file(tmp_path):
    (tmp_path / "blocker").write_text("x")
    _run_unchanged(tmp_path, ["cache", "model=tiny_qwen3", f"cache.root={tmp_path / 'blocker' / 'c'}"],
                   "cache.root", "is a file")


# -- export ---------------------------------------------------------------------------

def test_export_of_a_non_checkpoint_names_its_own_argument(tmp_path):
    (tmp_path / "empty").mkdir()
    line = _run_unchanged(tmp_path, ["export", str(tmp_path / "empty"), str(tmp_path / "out")], "checkpoint:")
    assert "eval.drafts" not in line


def test_export_refuses_a_file_and_a_non_empty_dir_unless_overwrite(tmp_path):
    folder, _ = _checkpoint(tmp_path)
    (tmp_path / "file").write_text("x")
    _run_unchanged(tmp_path, ["export", str(folder), str(tmp_path / "file")], "out_dir", "is a file")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    _run_unchanged(tmp_path, ["export", str(folder), str(busy)], "out_dir", "not empty", "--overwrite")
    run_cli(["export", str(folder), str(busy), "--overwrite"], cwd=tmp_path)
    assert (busy / "notes.txt").read_text() == "mine" and (busy / "model.safetensors").exists()
    assert (busy / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable by a server's user


@pytest.mark.parametrize("damage", ["garbage", "truncated", "config"])
def test_damaged_checkpoint_is_one_line_for_export_and_eval(tmp_path, damage):
    folder, _ = _checkpoint(tmp_path)
    weights = folder / "draft.safetensors"
    if damage == "garbage":
        weights.write_bytes(b"\x00garbage" * 10)
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:200])
    else:
        (folder / "draft_config.json").write_text("{not json")
    name = "draft_config.json" if damage == "config" else "draft.safetensors"
    _run_unchanged(tmp_path, ["export", str(folder), str(tmp_path / "out")], "checkpoint:", name, "damaged")
    _run_unchanged(tmp_path, ["eval", "model=tiny_qwen3", f"eval.drafts=[{folder}]",
                              f"eval.out_dir={tmp_path / 'ev'}"], "eval.drafts", name, "damaged")


def test_eval_refuses_a_draft_of_another_target(tmp_path):
    folder, _ = _checkpoint(tmp_path)  # trained for target "tiny" (hidden 64)
    meta = json.loads((folder / "draft_config.json").read_text())
    meta.update(target_model="tiny_qwen3_moe", target_hidden_size=64, aux_layer_ids=[1, 3, 4])
    (folder / "draft_config.json").write_text(json.dumps(meta))
    _run_unchanged(tmp_path, ["eval", "model=tiny_qwen3", f"eval.drafts=[{folder}]",
                              f"eval.out_dir={tmp_path / 'ev'}"], "eval.drafts", "another target", "tiny_qwen3_moe")


# -- training that goes wrong, or is stopped --------------------------------------------

def _train_args(tmp_path, steps):
    return ["train", "model=tiny_qwen3", "quant=mxfp4", f"trainer.max_steps={steps}", "trainer.save_every=1",
            "data.num_samples=16", "cache.dtype=fp32", f"cache.root={tmp_path / 'cache'}"]


def _poison_cached_features(tmp_path) -> Path:
    """Plant NaN in every sample's features, as a target that overflowed would have written
    them: the cache records the files as they now are (so no integrity check objects)."""
    (cache_dir,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    records = {}
    for shard in cache_dir.glob("shard-*.safetensors"):
        tensors = load_file(str(shard))
        for name in tensors:
            if "aux" in name and tensors[name].is_floating_point():
                tensors[name][..., 0] = float("nan")
        save_file(tensors, str(shard))
        records[shard.name] = file_record(shard)
    for listing in [cache_dir / "manifest.json", *cache_dir.glob("progress-r*.json")]:
        state = json.loads(listing.read_text())
        for s in state["shards"]:
            s.update(records[s["file"]])
        listing.write_text(json.dumps(state))
    return cache_dir


def test_nan_features_stop_training_and_keep_the_last_good_checkpoint(tmp_path):
    run_cli(_train_args(tmp_path, 2), cwd=tmp_path)
    run_dir = tmp_path / RUN
    final = load_file(str(run_dir / "checkpoints" / "final" / "draft.safetensors"))
    cache_dir = _poison_cached_features(tmp_path)
    proc = run_cli(_train_args(tmp_path, 4), cwd=tmp_path, check=False)
    line = _refused(proc, "training stopped at step 3", "not finite", "step-0000002")
    assert "NaN/Inf" in line  # the cause is named: the cached features, by sample and shard
    assert "in shard-r000-000000.safetensors" in line and str(cache_dir) in line
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-0000002"
    assert not (run_dir / "checkpoints" / "step-0000003").exists()
    after = load_file(str(run_dir / "checkpoints" / "final" / "draft.safetensors"))
    assert all(torch.equal(final[k], after[k]) for k in final)  # the final draft was not rewritten


def test_a_new_run_refused_at_its_first_step_leaves_no_run_folder(tmp_path):
    """Non-finite cached features stop a new run at step 1: the refusal leaves nothing the
    run made (its config.yaml and an empty metrics.jsonl were left before, #63)."""
    run_cli(_train_args(tmp_path, 1), cwd=tmp_path)
    _poison_cached_features(tmp_path)
    before = _tree(tmp_path)
    proc = run_cli([*_train_args(tmp_path, 2), "hydra.run.dir=runs/second"], cwd=tmp_path, check=False)
    _refused(proc, "training stopped at step 1", "not finite")
    assert not (tmp_path / "runs" / "second").exists()
    assert _tree(tmp_path) == before


def test_ctrl_c_is_one_line_saying_how_to_resume(tmp_path):
    args = _train_args(tmp_path, 10_000)
    # A shell starts background jobs with SIGINT ignored, and children inherit that: give
    # the command the default disposition, as a terminal would, however pytest was started.
    proc = subprocess.Popen([sys.executable, "-m", "specft.cli", *args], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    latest = tmp_path / RUN / "checkpoints" / "latest"
    try:
        while not latest.exists() and proc.poll() is None:  # training has started
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=3600)
    finally:
        proc.kill()  # a failed run must not go on training 10,000 steps
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1].startswith("interrupted: specft train stopped")
    assert "resumes" in err.strip().splitlines()[-1]


def test_resume_survives_a_damaged_pointer_state_and_metrics_line(tmp_path):
    run_cli(_train_args(tmp_path, 2), cwd=tmp_path)
    ckpts = tmp_path / RUN / "checkpoints"
    (ckpts / "latest").write_bytes(b"\xff\x00garbage")
    for state in (ckpts / "step-0000002").rglob("*.pt"):  # a truncated DeepSpeed state
        state.write_bytes(state.read_bytes()[:100])
    with open(tmp_path / RUN / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "split": "tr')  # a line cut short by a kill
    proc = run_cli(_train_args(tmp_path, 3), cwd=tmp_path)
    assert "latest is damaged" in proc.stderr and "cannot be loaded" in proc.stderr
    assert "resumed from" in proc.stderr and "step-0000001 (step 1)" in proc.stderr
    steps = [json.loads(ln)["step"] for ln in (tmp_path / RUN / "metrics.jsonl").read_text().splitlines()
             if json.loads(ln)["split"] == "train"]
    assert steps == [1, 2, 3]
