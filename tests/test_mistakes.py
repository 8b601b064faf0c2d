"""The classes of user mistake that used to end in a traceback, a silently wrong cache or
a clobbered run (issue 33), one test or more per class:

- settings that change a stored artifact's layout but not its key (shard size);
- writes that race (two processes on one run dir, cache or export);
- checks that ran after the first write (data, model.path, working directory, resume);
- a full disk during a write;
- a multirun with a failing job.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from omegaconf import OmegaConf
from test_bad_inputs import RUN, _fake_trained_run, _refused, _run_unchanged, _tree

from specft.cache import CacheReader, ensure_cache
from specft.cache.info import describe
from specft.common.errors import SpecftError
from specft.common.lock import dir_lock, sibling_lock

from conftest import run_cli
from helpers import root_cfg

TINY = ["model=tiny_qwen3", "data.num_samples=8", "trainer.max_steps=2"]


def _cache_cfg(tmp_path, where: str, per_shard: int, samples: int = 16):
    return root_cfg("model=tiny_qwen3", "quant=mxfp4", f"data.num_samples={samples}",
                    f"cache.samples_per_shard={per_shard}", "cache.dtype=fp32", f"cache.dir={tmp_path / where}")


def _shard_bytes(cache_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(cache_dir.glob("shard-*"))}


def _python_cli(tmp_path, prelude: str, args: list[str], env=None):
    """`specft ARGS` in a fresh interpreter after ``prelude`` (a patch standing in for
    what a test cannot make real: a full disk, a folder root may not write)."""
    code = prelude + f"\nimport sys\nfrom specft.cli import main\nsys.exit(main({args!r}))\n"
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=3600)


# -- a stored artifact's layout, not in its key --------------------------------------------

@pytest.mark.parametrize("damage", ["deleted shard", "interrupted build"])
def test_cache_repaired_with_another_shard_size_is_bit_identical_to_a_fresh_one(tmp_path, damage):
    fresh = ensure_cache(_cache_cfg(tmp_path, "fresh", per_shard=4))
    work = tmp_path / "work"
    shutil.copytree(fresh, work)
    if damage == "deleted shard":
        (work / "shard-r000-000001.safetensors").unlink()
    else:  # killed after two shards: no manifest, the progress file lists what is done
        progress = json.loads((work / "progress-r000.json").read_text())
        for s in progress["shards"][2:]:
            (work / s["file"]).unlink()
        progress["shards"] = progress["shards"][:2]
        (work / "progress-r000.json").write_text(json.dumps(progress))
        (work / "manifest.json").unlink()
    # cache.samples_per_shard is not in the cache key: the same cache is found, and must
    # be finished in its own layout (4 per shard), not the command line's 3.
    assert ensure_cache(_cache_cfg(tmp_path, "work", per_shard=3), verify=True) == work
    assert _shard_bytes(work) == _shard_bytes(fresh)
    assert describe(work, verify=True)[1] == []
    manifest = json.loads((work / "manifest.json").read_text())
    assert manifest["num_samples"] == 16
    indices = [i for s in manifest["shards"] for i in s["sample_index"]]
    assert sorted(indices) == list(range(16))


def test_a_cache_whose_shards_disagree_with_its_layout_is_refused(tmp_path):
    cache = ensure_cache(_cache_cfg(tmp_path, "c", per_shard=4))
    progress = json.loads((cache / "progress-r000.json").read_text())
    progress["shards"][1]["sample_index"] = progress["shards"][0]["sample_index"]  # written twice
    (cache / "progress-r000.json").write_text(json.dumps(progress))
    (cache / "manifest.json").unlink()
    with pytest.raises(SpecftError, match="holds other samples than this run lays out"):
        ensure_cache(_cache_cfg(tmp_path, "c", per_shard=4))


def test_a_target_that_overflows_is_refused_before_the_shard_is_written(tmp_path, monkeypatch):
    import specft.target_model as target_model

    real, calls = target_model.FeatureCapture.__call__, []

    def overflowing(self, ids, attn):
        aux, final = real(self, ids, attn)
        calls.append(1)
        if len(calls) == 2:  # the second batch: the first shard is already complete
            final[0, 0, 0] = float("inf")
        return aux, final

    monkeypatch.setattr(target_model.FeatureCapture, "__call__", overflowing)
    cfg = root_cfg("model=tiny_qwen3", "data.num_samples=12", "cache.samples_per_shard=4", "cache.batch_size=4",
                   f"cache.dir={tmp_path / 'c'}")
    with pytest.raises(SpecftError, match=r"hidden states for sample \d+ are not finite"):
        ensure_cache(cfg)
    assert [p.name for p in (tmp_path / "c").glob("shard-*")] == ["shard-r000-000000.safetensors"]
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_a_cache_listing_a_sample_twice_is_refused_when_opened(tmp_path):
    cache = ensure_cache(_cache_cfg(tmp_path, "c", per_shard=4))
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["shards"][1]["sample_index"][0] = manifest["shards"][0]["sample_index"][0]
    (cache / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecftError, match=r"sample \d+ is in both shard-r000-000000"):
        CacheReader(cache)


# -- writes that race ----------------------------------------------------------------------

def test_a_second_train_in_a_run_dir_in_use_is_refused_naming_the_holder(tmp_path):
    run_cli(["train", *TINY], cwd=tmp_path)
    with dir_lock(tmp_path / RUN, "run_dir", "specft train"):  # a live holder: this process
        line = _run_unchanged(tmp_path, ["train", *TINY[:2], "trainer.max_steps=4"],
                              "run_dir:", "is in use by", f"pid {os.getpid()}", "specft train")
    assert "wait for it to finish" in line


def test_a_lock_left_by_a_dead_run_is_taken_over(tmp_path):
    run_dir = tmp_path / RUN
    run_dir.mkdir(parents=True)
    (run_dir / ".specft.lock").write_text(json.dumps({"pid": 4194305, "host": "gone", "command": "specft train"}))
    proc = run_cli(["train", *TINY], cwd=tmp_path)
    assert "took over the lock" in proc.stderr and "pid 4194305" in proc.stderr
    assert (run_dir / "checkpoints" / "final" / "draft.safetensors").is_file()
    assert not (run_dir / ".specft.lock").exists()  # released when the run ended


def test_a_cache_being_built_by_another_process_is_refused(tmp_path):
    cfg = root_cfg(*TINY, f"cache.root={tmp_path / 'cache'}")
    from specft.cache import locate_cache

    cache_dir, _, _ = locate_cache(cfg)
    with dir_lock(cache_dir, "cache", "specft cache"):
        _refused(run_cli(["cache", *TINY], cwd=tmp_path, check=False), "cache:", "is in use by")
    assert not (tmp_path / RUN / "config.yaml").exists()


def test_with_cache_wait_a_cache_being_built_is_waited_for_then_built(tmp_path):
    """cache.wait=true: the second process names the holder, waits for it to end (the
    kernel hands the flock over), and then builds (or, were it finished, reads) the cache."""
    cfg = root_cfg(*TINY, f"cache.root={tmp_path / 'cache'}")
    from specft.cache import locate_cache
    from specft.cache.writer import cache_is_complete

    cache_dir, provenance, _ = locate_cache(cfg)
    holder = dir_lock(cache_dir, "cache", "specft cache").acquire()
    proc = subprocess.Popen([sys.executable, "-m", "specft.cli", "cache", *TINY, f"cache.root={tmp_path / 'cache'}",
                             "cache.wait=true"], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # blocks until the waiting line (or the end, should it fail)
        seen.append(line)
        if "waiting for it to finish" in line:
            break
    assert seen and "waiting for it to finish" in seen[-1], "".join(seen)[-2000:]
    assert not cache_is_complete(cache_dir, provenance) and proc.poll() is None
    assert f"pid {os.getpid()}" in seen[-1] and "specft cache" in seen[-1]
    holder.release()
    rest = proc.stderr.read()
    assert proc.wait() == 0, rest[-2000:]
    assert cache_is_complete(cache_dir, provenance)


def test_a_lock_waited_for_is_taken_when_its_holder_lets_go(tmp_path, monkeypatch):
    """The same in one process: a thread waits on the lock a first holder keeps, and
    takes it as soon as the holder releases it."""
    import threading

    from specft.common import lock as lock_module

    waiting = threading.Event()
    monkeypatch.setattr(lock_module.log, "info", lambda msg, *args: waiting.set())
    first = dir_lock(tmp_path, "cache", "specft cache").acquire()
    taken = []
    thread = threading.Thread(target=lambda: taken.append(dir_lock(tmp_path, "cache").acquire(wait=True)))
    thread.start()
    assert waiting.wait(timeout=600)  # a bound against a hang, not a timing
    assert not taken
    first.release()
    thread.join(timeout=600)
    assert not thread.is_alive() and taken and json.loads((tmp_path / ".specft.lock").read_text())["pid"] == os.getpid()
    taken[0].release()
    assert not (tmp_path / ".specft.lock").exists()


def test_an_export_into_a_folder_another_export_holds_is_refused(tmp_path):
    run_cli(["train", *TINY], cwd=tmp_path)
    out = tmp_path / "export"
    with sibling_lock(out, "out_dir", "specft export"):
        _refused(run_cli(["export", RUN, str(out)], cwd=tmp_path, check=False), "out_dir:", "in use")
    assert not out.exists()
    run_cli(["export", RUN, str(out)], cwd=tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


# -- checks before the first write ---------------------------------------------------------

@pytest.mark.parametrize("content, needle", [
    (None, "no such file"),
    ("", "no usable conversations"),
    ("{not json\n", "bad_json"),
    ('{"text": "no messages field"}\n', "unknown_record"),
])
def test_bad_data_file_is_refused_before_any_run_dir_exists(tmp_path, content, needle):
    if content is not None:
        (tmp_path / "data.jsonl").write_text(content)
    _run_unchanged(tmp_path, ["train", *TINY, "data=jsonl", "data.path=data.jsonl"], "data", needle)
    assert not (tmp_path / "runs").exists()


def test_model_path_that_does_not_exist_is_one_line_and_nothing_written(tmp_path):
    _run_unchanged(tmp_path, ["cache", "model=qwen3_8b", f"model.path={tmp_path / 'no-such-model'}"],
                   "model.path: no such directory")
    assert not (tmp_path / "runs").exists()


def test_model_path_given_to_a_model_that_cannot_use_it_is_refused(tmp_path):
    _run_unchanged(tmp_path, ["train", *TINY, f"model.path={tmp_path}"], "model.path:", "reads no model.path")


def test_an_unwritable_working_directory_is_one_line_before_hydra_writes(tmp_path):
    # Root writes anywhere, so the test denies writing where the OS would for a user.
    prelude = textwrap.dedent(f"""
        import os
        real = os.access
        os.access = lambda p, mode, **kw: False if (mode & os.W_OK and os.path.realpath(p) == {str(tmp_path)!r}) \\
            else real(p, mode, **kw)
    """)
    before = _tree(tmp_path)
    line = _refused(_python_cli(tmp_path, prelude, ["train", *TINY]), "run_dir", "is not writable")
    assert str(tmp_path) in line
    assert _tree(tmp_path) == before and not (tmp_path / "runs").exists()


def test_empty_specft_home_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specft.cli", "train", *TINY], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "SPECFT_HOME": ""}, timeout=3600)
    _refused(proc, "SPECFT_HOME: set but empty")
    assert list(tmp_path.iterdir()) == []


def test_resume_after_the_only_step_checkpoint_was_deleted_is_refused(tmp_path):
    run_cli(["train", *TINY], cwd=tmp_path)
    shutil.rmtree(tmp_path / RUN / "checkpoints" / "step-0000002")
    line = _run_unchanged(tmp_path, ["train", *TINY[:2], "trainer.max_steps=4"],
                          "trainer.resume:", "step-0000002, which is gone", "trainer.resume=false")
    assert "None" not in line


def test_a_rerun_that_resumes_leaves_config_yaml_as_it_was(tmp_path):
    run_cli(["train", *TINY], cwd=tmp_path)
    config = tmp_path / RUN / "config.yaml"
    stamp = (config.stat().st_ino, config.stat().st_mtime_ns)
    run_cli(["train", *TINY], cwd=tmp_path)
    assert (config.stat().st_ino, config.stat().st_mtime_ns) == stamp
    run_cli(["train", *TINY[:2], "trainer.max_steps=3"], cwd=tmp_path)  # a resume-safe change is recorded
    assert OmegaConf.load(config).trainer.max_steps == 3


# -- a full disk ---------------------------------------------------------------------------

_FULL_AFTER_TWO_SHARDS = textwrap.dedent("""
    import specft.cache.writer as writer
    from safetensors import SafetensorError
    real, calls = writer.save_file, []
    def save_file(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) > 2:  # what safetensors raises when the disk fills (seen on a full tmpfs)
            open(path, "wb").write(b"partial")
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, metadata=metadata)
    writer.save_file = save_file
""")


def test_disk_full_while_caching_is_one_line_and_the_rerun_resumes(tmp_path):
    args = ["cache", "model=tiny_qwen3", "data.num_samples=16", "cache.samples_per_shard=4"]
    line = _refused(_python_cli(tmp_path, _FULL_AFTER_TWO_SHARDS, args), "disk full while writing",
                    "shard-r000-000002", "the 2 shard(s) finished before it are kept", "rerun the same command")
    (cache_dir,) = (tmp_path / "cache").iterdir()
    assert sorted(p.name for p in cache_dir.glob("*shard*")) == ["shard-r000-000000.safetensors",
                                                               "shard-r000-000001.safetensors"], line
    kept = _shard_bytes(cache_dir)
    run_cli(args, cwd=tmp_path)
    fresh = ensure_cache(root_cfg(*args[1:], f"cache.dir={tmp_path / 'fresh'}"))
    assert _shard_bytes(cache_dir) == _shard_bytes(fresh)
    assert {k: v for k, v in _shard_bytes(cache_dir).items() if k in kept} == kept


def test_disk_estimate_is_the_real_size_in_a_unit_that_fits(tmp_path):
    from specft.cache.writer import CacheWriter
    from specft.data import load_samples
    from specft.target_model import load_tokenizer

    for dtype in ("fp32", "bf16", "fp8"):
        cfg = root_cfg("model=tiny_qwen3", "data.num_samples=16", f"cache.dtype={dtype}",
                       f"cache.dir={tmp_path / dtype}")
        cache = ensure_cache(cfg)
        written = sum(p.stat().st_size for p in cache.glob("shard-*"))
        samples = load_samples(cfg.data, load_tokenizer(cfg.model))
        estimate = CacheWriter(cfg, cache, {}).estimate_bytes(samples)
        assert 0.95 < estimate / written <= 1.0, (dtype, estimate, written)  # headers aside


def test_too_little_free_space_names_sizes_in_kb_or_mb(tmp_path, monkeypatch):
    import specft.cache.writer as writer

    real = shutil.disk_usage
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(SpecftError, match=r"needs ~\d+\.\d (kB|MB) but only 1\.0 kB is free"):
        ensure_cache(_cache_cfg(tmp_path, "c", per_shard=4))


# -- multirun ------------------------------------------------------------------------------

def _multirun_with_a_bad_middle_job(tmp_path, *flags):
    # The middle job's cache.dir holds a cache of another target: found inside the job.
    ensure_cache(root_cfg("model=tiny_qwen3", "quant=fp8", "data.num_samples=8", f"cache.dir={tmp_path / 'b'}"))
    dirs = ",".join(str(tmp_path / n) for n in ("a", "b", "c"))
    return run_cli(["train", "-m", *flags, *TINY, f"cache.dir={dirs}"], cwd=tmp_path, check=False)


def test_multirun_goes_on_after_a_failed_job_and_summarizes(tmp_path):
    proc = _multirun_with_a_bad_middle_job(tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "multirun: 3 jobs: 2 finished, 1 failed, 0 skipped" in proc.stderr
    assert "failed: #1 cache.dir=" in proc.stderr and "built from different inputs" in proc.stderr
    jobs = sorted(p for p in (tmp_path / "runs" / "multirun").iterdir() if p.is_dir())
    # one folder per finished job, the cache path not spelled out as nested folders; the
    # refused job leaves none (rundir.RefusalUndo)
    assert len(jobs) == 2
    finals = [j for j in jobs if (j / "checkpoints" / "final" / "draft.safetensors").is_file()]
    assert [j.name.split(",")[0] for j in finals] == ["cache.dir=" + str(tmp_path.name) + "_a",
                                                      "cache.dir=" + str(tmp_path.name) + "_c"]


def test_multirun_fail_fast_skips_the_jobs_after_a_failure(tmp_path):
    proc = _multirun_with_a_bad_middle_job(tmp_path, "--fail-fast")
    assert proc.returncode == 2
    assert "multirun: 3 jobs: 1 finished, 1 failed, 1 skipped (--fail-fast)" in proc.stderr
    assert len(list((tmp_path / "runs" / "multirun").glob("*/checkpoints/final"))) == 1


# -- prompts for eval ----------------------------------------------------------------------

def test_eval_prompts_are_not_filtered_by_their_reference_answers(tmp_path):
    from specft.eval.prompts import load_prompts
    from specft.target_model import load_tokenizer

    rows = [{"question_id": i, "turns": [f"question {i}?"], "reference": ["4"] if i % 2 else []} for i in range(10)]
    rows.append({"question_id": 99, "turns": []})  # no question: left out, and counted
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = root_cfg("model=tiny_qwen3", "data=mtbench", f"data.path={path}", "eval.num_prompts=100")
    prompts, left_out = load_prompts(cfg, load_tokenizer(cfg.model))
    assert len(prompts) == 10
    assert left_out == {"unknown_record": 1}


# -- refused after the run dir is known: nothing left behind (issue 53) --------------------

def _everything(root) -> list[str]:
    """Folders too: an empty runs/<run>/ is what a refusal used to leave."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("drafts", ["no-such-run", "fake"])
def test_a_refused_eval_leaves_no_run_folder(tmp_path, drafts):
    """A draft that is not there, and a run folder without a draft checkpoint (a k past
    the trained slots: tests/test_parallel_drafting.py)."""
    fake = _fake_trained_run(tmp_path)
    shutil.move(fake, tmp_path / "fake")
    shutil.rmtree(tmp_path / "runs")
    before = _everything(tmp_path)
    _refused(run_cli(["eval", "model=tiny_qwen3", f"eval.drafts=[{drafts}]"], cwd=tmp_path, check=False),
             "eval.drafts:", "no draft checkpoint")
    assert _everything(tmp_path) == before


def test_a_train_refused_for_an_unreadable_manifest_leaves_no_run_folder(tmp_path):
    cache = tmp_path / "c"
    cache.mkdir()
    (cache / "manifest.json").write_text("{not json")
    before = _everything(tmp_path)
    _refused(run_cli(["train", *TINY, f"cache.dir={cache}"], cwd=tmp_path, check=False),
             "cannot read", "manifest.json")
    assert _everything(tmp_path) == before
