"""`specft train` end to end on the tiny models, as a user runs it."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specft.cache import CacheReader

from conftest import run_cli

RUN = "runs/tiny_qwen3-mxfp4-eagle3-kl"


def _metrics(run_dir: Path, split: str = "train") -> list[dict]:
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == split]


def _cache_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir())


@pytest.mark.parametrize("override, field, allowed", [
    ("quant=foo", "quant", "bf16, checkpoint, fp8, fp8_block"),
    ("model.aux_layer_ids=[1,3,99]", "model.aux_layer_ids", "0..7"),
    ("trainer.zero_stage=7", "trainer.zero_stage", "0, 1, 2, 3"),
    ("loss=nope", "loss", "kl"),
])
def test_invalid_value_is_one_line_exit_2_nothing_written(tmp_path, override, field, allowed):
    proc = run_cli(["train", "model=tiny_qwen3", override], cwd=tmp_path, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert field in lines[0] and allowed in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_train_tiny_qwen3_mxfp4_end_to_end_then_reuse(tmp_path):
    proc = run_cli(["train", "model=tiny_qwen3", "quant=mxfp4", "trainer.max_steps=30"], cwd=tmp_path)
    run_dir = tmp_path / RUN
    (cache_dir,) = _cache_dirs(tmp_path / "cache")
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_samples"] == 256
    assert manifest["provenance"]["quant"]["name"] == "mxfp4"
    assert (run_dir / "config.yaml").exists()
    for ckpt in ("final", "step-0000030"):
        assert (run_dir / "checkpoints" / ckpt / "draft.safetensors").exists()
        assert (run_dir / "checkpoints" / ckpt / "config.yaml").exists()
    m = _metrics(run_dir)
    assert [r["step"] for r in m] == list(range(1, 31))
    first, last = sum(r["loss"] for r in m[:5]) / 5, sum(r["loss"] for r in m[-5:]) / 5
    assert last < first - 0.2, (first, last)
    (val,) = _metrics(run_dir, "val")  # held-out samples, validated at the end
    assert val["step"] == 30 and 1.0 <= val["accept_len"] <= 6.0
    # 3 TTT steps trained (the default); validation unrolls on to eval.k's deepest, 5.
    assert [j for j in range(8) if f"acc_{j}" in m[0]] == [0, 1, 2]
    assert [j for j in range(8) if f"accept_{j}" in val] == [0, 1, 2, 3, 4]
    assert all(0.0 <= val[f"accept_{k}"] <= 1.0 for k in range(5))

    # Again: the cache is reused (no target forward, shards untouched), training is done.
    mtimes = {p: p.stat().st_mtime_ns for p in cache_dir.iterdir()}
    proc = run_cli(["train", "model=tiny_qwen3", "quant=mxfp4", "trainer.max_steps=30"], cwd=tmp_path)
    assert "cache: reusing" in proc.stderr and "quant mxfp4" not in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in cache_dir.iterdir()} == mtimes
    assert "already complete" in proc.stderr

    # A default Qwen3 draft (q/k norm) exports as vLLM's Qwen3 EAGLE-3 model, and the
    # speculators layout names its verifier so `LLM(model=EXPORT)` finds the target.
    run_cli(["export", str(run_dir), str(tmp_path / "eagle3")], cwd=tmp_path)
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    target_dir = Path(config["specft"]["target_path"])
    target_config = json.loads((target_dir / "config.json").read_text())
    assert config["max_position_embeddings"] == target_config["max_position_embeddings"] == 4096
    with safe_open(str(tmp_path / "eagle3" / "model.safetensors"), "pt") as f:
        assert {"midlayer.self_attn.q_norm.weight", "midlayer.self_attn.k_norm.weight"} <= set(f.keys())
    run_cli(["export", str(run_dir), str(tmp_path / "spec"), "--layout", "speculators"], cwd=tmp_path)
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"] == {"name_or_path": str(target_dir),
                                                      "architectures": ["Qwen3ForCausalLM"]}
    assert spec["transformer_layer_config"]["architectures"] == ["Qwen3ForCausalLM"]
    assert spec["transformer_layer_config"]["model_type"] == "qwen3"
    # A draft trained before the verifier was recorded: export finds it from the run config.
    draft_config = run_dir / "checkpoints" / "final" / "draft_config.json"
    meta = json.loads(draft_config.read_text())
    draft_config.write_text(json.dumps({k: v for k, v in meta.items() if k != "verifier"}))
    run_cli(["export", str(run_dir), str(tmp_path / "old"), "--layout", "speculators"], cwd=tmp_path)
    old = json.loads((tmp_path / "old" / "config.json").read_text())
    assert old["speculators_config"]["verifier"] == spec["speculators_config"]["verifier"]


def test_killed_training_resumes_exactly(tmp_path):
    args = ["train", "model=tiny_qwen3", "quant=mxfp4", "trainer.max_steps=40", "trainer.save_every=10",
            "data.num_samples=64", f"cache.root={tmp_path / 'cache'}"]
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), killed_dir.mkdir()
    run_cli(args, cwd=ref_dir)

    proc = subprocess.Popen([sys.executable, "-m", "specft.cli", *args], cwd=killed_dir,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latest = killed_dir / RUN / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not (latest.exists() and latest.read_text() >= "step-0000010") and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed_dir / RUN / "checkpoints" / "final").exists(), "finished before the kill"

    out = run_cli(args, cwd=killed_dir)
    assert "resumed from" in out.stderr
    ref, got = _metrics(ref_dir / RUN), _metrics(killed_dir / RUN)
    assert [r["step"] for r in got] == list(range(1, 41))
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]  # to the last digit
    assert _metrics(killed_dir / RUN, "val") == _metrics(ref_dir / RUN, "val")


def test_amp_bf16_trains_in_bf16_autocast_with_float32_weights(tmp_path):
    common = ["train", "model=tiny_qwen3", "data.num_samples=32", "trainer.max_steps=20", "trainer.save_every=20"]
    run_cli([*common, "run_dir=fp32"], cwd=tmp_path)
    run_cli([*common, "trainer.precision=amp_bf16", "run_dir=amp"], cwd=tmp_path)
    fp32, amp = _metrics(tmp_path / "fp32"), _metrics(tmp_path / "amp")
    assert [r["loss"] for r in amp] != [r["loss"] for r in fp32]  # the forward did run in bf16
    assert sum(r["loss"] for r in amp[-5:]) < sum(r["loss"] for r in amp[:5]) - 1.0  # and it trains
    assert abs(amp[-1]["loss"] - fp32[-1]["loss"]) < 0.05 * fp32[-1]["loss"]
    with safe_open(str(tmp_path / "amp/checkpoints/final/draft.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys() if f.get_tensor(k).is_floating_point()} == {torch.float32}


def test_moe_target(tmp_path):
    run_cli(["train", "model=tiny_qwen3_moe", "quant=mxfp4", "trainer.max_steps=10"], cwd=tmp_path)
    run_dir = tmp_path / "runs/tiny_qwen3_moe-mxfp4-eagle3-kl"
    assert len(_metrics(run_dir)) == 10
    assert (run_dir / "checkpoints/final/draft.safetensors").exists()


def test_two_ranks_write_the_same_cache_as_one(tmp_path):
    # With regeneration: each rank answers its own prompts (one at a time, so batch
    # padding cannot move a greedy token) and the caches still agree sample by sample.
    common = ["model=tiny_qwen3", "quant=mxfp4", "data.num_samples=24", "cache.samples_per_shard=5",
              "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=6",
              "data.regenerate.batch_size=1"]
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    run_cli(["cache", *common], cwd=tmp_path / "one")
    run_cli(["train", *common, "trainer.nproc=2", "trainer.max_steps=6"], cwd=tmp_path / "two")
    (one,) = _cache_dirs(tmp_path / "one" / "cache")
    (two,) = _cache_dirs(tmp_path / "two" / "cache")
    assert one.name == two.name  # same provenance
    assert {p.name for p in two.glob("shard-r001-*")}, "rank 1 wrote no shard"
    assert (two / "regenerated-r001.jsonl").exists()
    a, b = CacheReader(one), CacheReader(two)
    assert len(a) == len(b) == 24
    for i in range(24):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        # bf16 storage; different batch padding may move the last bit.
        torch.testing.assert_close(x["aux_hidden"], y["aux_hidden"], rtol=1e-2, atol=1e-2)
    m = _metrics(tmp_path / "two" / "runs/tiny_qwen3-mxfp4-eagle3-kl")
    assert [r["step"] for r in m] == list(range(1, 7))


def test_multirun_runs_one_job_per_value(tmp_path):
    run_cli(["train", "-m", "model=tiny_qwen3", "quant=bf16,mxfp4", "trainer.max_steps=3"], cwd=tmp_path)
    finals = sorted(tmp_path.glob("runs/multirun/*/checkpoints/final/draft.safetensors"))
    assert len(finals) == 2
    quants = sorted(json.loads((f.parent / "draft_config.json").read_text())["quant"] for f in finals)
    assert quants == ["bf16", "mxfp4"]


def test_wandb_offline_run_holds_metrics(tmp_path):
    run_cli(["train", "model=tiny_qwen3", "quant=bf16", "logger=wandb", "trainer.max_steps=3"], cwd=tmp_path)
    (record,) = tmp_path.glob("runs/*/wandb/offline-run-*/run-*.wandb")
    data = record.read_bytes()
    # wandb 0.31 has no Python reader for its record log; history values are stored as
    # their JSON text, so every logged loss must appear verbatim.
    (metrics_file,) = tmp_path.glob("runs/*/metrics.jsonl")
    losses = [json.loads(ln)["loss"] for ln in metrics_file.read_text().splitlines()]
    assert len(losses) == 4 and b"train/acc_0" in data and b"val/accept_len" in data
    assert all(json.dumps(v).encode() in data for v in losses)


@pytest.mark.parametrize("extra", [
    ["draft.quant=mxfp4", "loss=kl_hidden"],
    ["trainer.zero_stage=2", "loss=lk", "trainer.grad_accum=2"],
    ["trainer.zero_stage=3", "loss=tv"],
    ["trainer.precision=bf16", "loss=ce"],
    ["draft=mtp", "draft.quant=fp8"],
    ["draft.num_layers=2", "draft.num_heads=8", "draft.num_kv_heads=8", "draft.head_dim=8",
     "draft.hidden_size=48", "draft.intermediate_size=96"],
    ["trainer.mix_quant=bf16", "trainer.feature_noise=0.05", "draft.ttt_steps=3",
     "draft.step_weights=[1.0,0.5,0.25]"],
    ["draft.init=target_layer", "draft.init_layer=5"],
])
def test_training_variants_run_and_checkpoint(tmp_path, extra):
    proc = run_cli(["train", "model=tiny_qwen3", "quant=mxfp4", "trainer.max_steps=4",
                    "data.num_samples=48", *extra], cwd=tmp_path)
    if "trainer.mix_quant=bf16" in extra:  # both targets' caches were built
        assert {p.name.split("-")[1] for p in (tmp_path / "cache").iterdir()} == {"bf16", "mxfp4"}
        assert "quant bf16:" in proc.stderr and "quant mxfp4:" in proc.stderr
    if "draft.init=target_layer" in extra:  # q/k/v/o, q/k norm, the MLP, two norms of the target's layer 5
        assert "draft init: 11 tensors from the target's decoder layer 5" in proc.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    m = _metrics(run_dir)
    assert [r["step"] for r in m] == [1, 2, 3, 4] and all(r["loss"] == r["loss"] for r in m)
    from safetensors.torch import load_file

    state = load_file(str(run_dir / "checkpoints/final/draft.safetensors"))
    key, shape = ("eh_proj.weight", (64, 128)) if "draft=mtp" in extra else ("fc.weight", (64, 192))
    if "draft.hidden_size=48" in extra:
        key, shape = "fc.weight", (48, 192)  # 3 x target hidden 64 -> draft hidden 48
        assert state["extra_layers.0.mlp.down_proj.weight"].shape == (48, 96)
    assert state[key].shape == shape  # consolidated, even under ZeRO-3


def test_two_ranks_match_one_rank_with_the_same_global_batch(tmp_path):
    """Global batch 8: one rank runs two micro-batches of 4 (gradient accumulation), two
    ranks one micro-batch of 4 each, over the same samples. Gradients are the same mean,
    so losses agree up to float summation order (stated tolerance: 1e-5 relative). The
    same holds with the target head's rows split over the two ranks."""
    common = ["model=tiny_qwen3", "quant=mxfp4", "data.num_samples=64", "trainer.max_steps=6",
              "trainer.micro_batch_size=4", f"cache.root={tmp_path / 'cache'}"]
    for name in ("one", "two", "sharded"):
        (tmp_path / name).mkdir()
    run_cli(["train", *common, "trainer.grad_accum=2"], cwd=tmp_path / "one")
    run_cli(["train", *common, "trainer.nproc=2"], cwd=tmp_path / "two")
    proc = run_cli(["train", *common, "trainer.nproc=2", "trainer.target_head=sharded"],
                   cwd=tmp_path / "sharded")
    assert "target head: sharded, 1024 of 2048 rows per rank" in proc.stderr
    one = _metrics(tmp_path / "one" / RUN)
    for other in ("two", "sharded"):
        two = _metrics(tmp_path / other / RUN)
        assert [r["tokens"] for r in one] == [r["tokens"] for r in two]
        for a, b in zip(one, two):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (other, a["step"], a["loss"], b["loss"])
    (val,) = _metrics(tmp_path / "sharded" / RUN, "val")
    (val_two,) = _metrics(tmp_path / "two" / RUN, "val")
    assert val["tokens"] == val_two["tokens"] and val["loss"] == pytest.approx(val_two["loss"], rel=1e-5)


def test_mismatched_cache_inside_a_job_is_one_line_exit_2(tmp_path):
    common = ["model=tiny_qwen3", "data.num_samples=8", f"cache.dir={tmp_path / 'c'}"]
    run_cli(["cache", "quant=mxfp4", *common], cwd=tmp_path)
    proc = run_cli(["cache", "quant=fp8", *common], cwd=tmp_path, check=False)
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "quant.name: cache has 'mxfp4', this run has 'fp8'" in errors[0]
    assert "Traceback" not in proc.stderr


def test_info_describes_a_cache(tmp_path):
    run_cli(["cache", "model=tiny_qwen3", "quant=fp8", "data.num_samples=8", "cache.dtype=fp8"], cwd=tmp_path)
    (cache_dir,) = _cache_dirs(tmp_path / "cache")
    out = run_cli(["info", str(cache_dir)], cwd=tmp_path).stdout
    assert "(complete)" in out and "quant      fp8 (weight e4m3 channel" in out
    assert "storage    fp8, 1 shards" in out and "contents   8 samples" in out
    bad = run_cli(["info", str(tmp_path)], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: info:")


def test_eval_decodes_with_the_trained_draft_and_writes_reports(tmp_path):
    common = ["model=tiny_qwen3", "quant=mxfp4"]
    run_cli(["train", *common, "trainer.max_steps=4"], cwd=tmp_path)
    proc = run_cli(["eval", *common, "eval.k=[1,3]", "eval.batch_sizes=[1,4]", "eval.num_prompts=4",
                    "eval.max_new_tokens=12"], cwd=tmp_path)
    out = tmp_path / "runs/tiny_qwen3-mxfp4-eagle3-kl/eval"
    report = json.loads((out / "results.json").read_text())
    results = report["results"]
    # The draft reads the target's own embedding (its frozen copy holds the same values).
    assert report["meta"]["drafts"]["tiny_qwen3-mxfp4-eagle3-kl"]["shares_target_embedding"] is True
    assert [(r["draft"], r["k"], r["batch_size"]) for r in results] == [
        ("target alone", 0, 1), ("tiny_qwen3-mxfp4-eagle3-kl", 1, 1), ("tiny_qwen3-mxfp4-eagle3-kl", 3, 1),
        ("target alone", 0, 4), ("tiny_qwen3-mxfp4-eagle3-kl", 1, 4), ("tiny_qwen3-mxfp4-eagle3-kl", 3, 4)]
    for r in results:
        assert r["generated_tokens"] > 0 and r["latency_ms_per_token"] > 0
        if r["k"]:
            assert r["proposed"] > 0 and 0 <= r["acceptance_rate"] <= 1 and len(r["acceptance_at"]) == r["k"]
            assert r["memory_vs_target_alone"] > 0 and "flip_rate" in r
            lo, hi = r["acceptance_rate_ci"]
            assert lo <= r["acceptance_rate"] <= hi
            assert [sum(c) for c in zip(*r["per_prompt"])] == [r["target_forwards"], r["proposed"], r["accepted"]]
    for name in ("results.md", "acceptance_by_position.png", "latency_by_k.png"):
        assert (out / name).stat().st_size > 0
    assert "| target alone | 0 | 1 |" in proc.stdout
    # Two drafts on the same prompts get a paired difference; the same draft twice is none.
    run = str(tmp_path / "runs/tiny_qwen3-mxfp4-eagle3-kl")
    run_cli(["eval", *common, f"eval.drafts=[{run},{run}]", "eval.labels=[a,b]", "eval.k=[3]",
             "eval.batch_sizes=[2]", "eval.num_prompts=4", "eval.max_new_tokens=12", "eval.target_alone=false",
             f"eval.out_dir={tmp_path / 'pair'}"], cwd=tmp_path)
    (pair,) = json.loads((tmp_path / "pair" / "results.json").read_text())["comparisons"]
    assert (pair["a"], pair["b"], pair["rate_difference"], pair["distinguishable"]) == ("a", "b", 0.0, False)
    assert "no difference" in (tmp_path / "pair" / "results.md").read_text()
    bad = run_cli(["eval", *common, "eval.drafts=[nowhere]"], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: eval.drafts: no draft")


def test_heldout_validation_replays_decoding_on_target_answers(tmp_path):
    """trainer.val_data=heldout: validation reads the data's validation side with the
    target's own answers (a cache of its own) and replays greedy decoding at eval.k; on
    the same prompts `specft eval` counts about the same."""
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i + 3}?",
                                        "response": f"It is {2 * i + 3}."}) + "\n" for i in range(60)))
    common = ["model=tiny_qwen3", "quant=mxfp4", "data=jsonl", f"data.path={data}", "data.split=train", "eval.k=[2,3]",
              "eval.max_new_tokens=12", "data.regenerate.max_new_tokens=12", "data.regenerate.batch_size=1",
              "cache.dtype=fp32", "data.val_fraction=0.2"]
    # Two TTT steps trained, eval.k up to 3: validation unrolls a step further than training.
    proc = run_cli(["train", *common, "trainer.max_steps=20", "draft.ttt_steps=2", "trainer.val_data=heldout",
                    "trainer.val_samples=4", "trainer.val_batches=2", "trainer.micro_batch_size=2",
                    "draft.vocab_size=512", "draft.vocab_fill=prior"], cwd=tmp_path)
    assert "replayed decoding: k=2 acceptance" in proc.stderr
    # The answers hold fewer distinct tokens than 512: the target's prior fills the rest.
    assert re.search(r"draft vocab: 512 tokens \(\d+ seen in training answers, the rest by the target's prior\)"
                     r" cover 100.0% of training answer tokens; [\d.]+% of held-out ones", proc.stderr), proc.stderr
    run = tmp_path / "runs/tiny_qwen3-mxfp4-eagle3-kl"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val, trained = records[-1], next(r for r in records if r["split"] == "train")
    assert val["split"] == "val" and val["tokens"] > 0
    assert "acc_1" in trained and "acc_2" not in trained and "acc_2" in val
    assert len(val["replay_per_prompt_k3"]) == 4  # one [rounds, proposed, accepted] per held-out sample
    lo, hi = val["replay_accept_rate_ci_k3"]
    assert lo <= val["replay_accept_rate_k3"] <= hi
    caches = {json.loads((d / "manifest.json").read_text())["provenance"]["data"]["split"]: d
              for d in (tmp_path / "cache").iterdir()}
    assert set(caches) == {"train", "validation"}
    held = json.loads((caches["validation"] / "manifest.json").read_text())
    assert held["num_samples"] == 4 and held["data_summary"]["regenerated"] == 4
    proc = run_cli(["eval", *common, "data.split=validation", "eval.num_prompts=4", "eval.batch_sizes=[1]",
                    "eval.target_alone=false"], cwd=tmp_path)
    results = json.loads((run / "eval" / "results.json").read_text())["results"]
    for r in results:
        assert abs(val[f"replay_accept_rate_k{r['k']}"] - r["acceptance_rate"]) <= 0.1, (r["k"], val)
    bad = run_cli(["train", "model=tiny_qwen3", "trainer.val_data=heldout"], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "set data.split=train" in bad.stderr.strip().splitlines()[-1]


def test_heldout_validation_of_a_mix_scores_each_source(tmp_path):
    """A mix validates on one held-out cache per source: the record scores every prompt
    set apart (`<source>/replay_*`) and together, and the log line names each."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i + 3}?", "response": "x"}) + "\n"
                         for i in range(40)))
    b.write_text("".join(json.dumps({"prompt": f"Name a colour, {i}.", "response": "y"}) + "\n" for i in range(40)))
    mix = f"data.mix=[{{name: jsonl, path: '{a}'}},{{name: jsonl, path: '{b}', val_fraction: 0.3}}]"
    proc = run_cli(["train", "model=tiny_qwen3", "quant=mxfp4", "data=mix", mix, "data.split=train",
                    "data.val_fraction=0.2", "eval.k=[2]", "eval.max_new_tokens=8",
                    "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=8",
                    "data.regenerate.batch_size=4", "cache.dtype=fp32", "trainer.max_steps=4",
                    "draft.ttt_steps=2", "trainer.val_data=heldout", "trainer.val_samples=3",
                    "trainer.val_batches=8", "trainer.micro_batch_size=2", "run_dir=run"], cwd=tmp_path)
    assert re.search(r"k=2 acceptance [\d.]+ \(length [\d.]+; jsonl_0 [\d.]+; jsonl_1 [\d.]+\)", proc.stderr), \
        proc.stderr[-2000:]
    val = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    apart = [val[f"jsonl_{i}/replay_per_prompt_k2"] for i in (0, 1)]
    assert [len(rows) for rows in apart] == [3, 3]
    assert sorted(apart[0] + apart[1]) == sorted(val["replay_per_prompt_k2"])
    for i, rows in enumerate(apart):
        accepted, proposed = sum(r[2] for r in rows), sum(r[1] for r in rows)
        assert val[f"jsonl_{i}/replay_accept_rate_k2"] == pytest.approx(accepted / proposed)
    splits = sorted(json.loads((d / "manifest.json").read_text())["provenance"]["data"]["split"]
                    for d in (tmp_path / "cache").iterdir())
    assert splits == ["train", "validation", "validation"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: eval.device=cuda would run")
def test_eval_on_a_device_this_machine_lacks_is_one_line(tmp_path):
    bad = run_cli(["eval", "model=tiny_qwen3", "eval.device=cuda"], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "error: eval.device: cuda is not available on this machine; use eval.device=auto or cpu")
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # refused before anything was written
