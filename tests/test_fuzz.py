"""The fuzz suite (#63): every kind of file and reply specft reads, started from a valid
fixture and mutated by hypothesis (truncated, bytes flipped, keys dropped, duplicated or
retyped, shapes and dtypes changed, fields contradicted), then read by what the command
reads it with. Each input must be taken, or refused with one SpecftError line (the CLI
prints it as one `error:` line and exits 2); any other exception is a failure, and the
reader leaves the input's folder as it found it.

Seeded and bounded: the default suite tries a few inputs per kind (FUZZ_EXAMPLES, 12);
`make fuzz` runs the `fuzz` profile (300 per kind, SPECFT_FUZZ_EXAMPLES to change it) and
saves every input that fails under fuzz-failures/, hypothesis' own database keeping the
shrunk example for the next run. docs/reliability.md has the counts."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from specft.common.errors import SpecftError

from helpers import checkpoint_model, root_cfg

CHECKPOINTS = Path(__file__).resolve().parent / "fixtures" / "checkpoints"
GGUF = CHECKPOINTS / "tiny_qwen3_gguf" / "Q8_0" / "tiny-Q8_0.gguf"
AUX = "model.aux_layer_ids=[0,1,2]"
SAVE = Path(os.environ["SPECFT_FUZZ_SAVE"]) if os.environ.get("SPECFT_FUZZ_SAVE") else None

settings.register_profile("default", max_examples=int(os.environ.get("FUZZ_EXAMPLES", "12")), deadline=None,
                          derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("fuzz", max_examples=int(os.environ.get("SPECFT_FUZZ_EXAMPLES", "300")), deadline=None,
                          print_blob=True, report_multiple_bugs=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("SPECFT_FUZZ_PROFILE", "default"))

TRIED: dict[str, int] = {}  # inputs read per kind (printed by `make fuzz`)


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def takes_or_refuses(kind: str, where: Path, read) -> None:
    """``read()`` returns, or raises SpecftError with one line; ``where`` is unchanged."""
    TRIED[kind] = TRIED.get(kind, 0) + 1
    before = _tree(where)
    try:
        read()
    except SpecftError as err:
        assert "\n" not in str(err).strip() and str(err).strip(), f"{kind}: a refusal of several lines: {err!r}"
    except BaseException as err:  # anything else reaches the user as a traceback
        if SAVE is not None:
            saved = SAVE / f"{kind}-{hashlib.sha256(repr(err).encode()).hexdigest()[:10]}"
            if not saved.exists():
                shutil.copytree(where, saved)
        raise
    assert _tree(where) == before, f"{kind}: the reader changed its input's folder"


def _scratch(tmp_path_factory, name: str) -> Path:
    return tmp_path_factory.mktemp(name, numbered=True)


# -- mutations of JSON documents ------------------------------------------------------------

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
                           | st.text(max_size=12),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=3), max_leaves=6)


def _paths(doc, prefix=()) -> list[tuple]:
    """Every key path in a JSON document (lists by index)."""
    out = [prefix] if prefix else []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    for key, value in items:
        out += _paths(value, (*prefix, key))
    return out


@st.composite
def json_mutation(draw, doc):
    """The document with one key dropped, retyped, duplicated under another name, or
    its value nudged (a number off by one, a string cut): what a hand edit or another
    tool's version does."""
    doc = json.loads(json.dumps(doc))
    paths = _paths(doc)
    if not paths:
        return draw(JSON_VALUES)
    path = draw(st.sampled_from(paths))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    action = draw(st.sampled_from(["drop", "retype", "duplicate", "nudge"]))
    if action == "drop":
        del parent[key]
    elif action == "retype":
        parent[key] = draw(JSON_VALUES)
    elif action == "duplicate" and isinstance(parent, dict):
        parent[f"{key}_{draw(st.integers(0, 9))}"] = parent[key]
    else:
        value = parent[key]
        if isinstance(value, bool):
            parent[key] = not value
        elif isinstance(value, (int, float)):
            parent[key] = value + draw(st.sampled_from([-1, 1, -value, 2 * value + 1]))
        elif isinstance(value, str):
            parent[key] = value[: draw(st.integers(0, max(0, len(value) - 1)))]
        elif isinstance(value, list) and value:
            parent[key] = value[:-1]
    return doc


# -- GGUF files ---------------------------------------------------------------------------------

def _gguf_regions(path: Path) -> dict[str, tuple[int, int]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    infos = min(t.field.offset for t in reader.tensors)
    data = min(t.data_offset for t in reader.tensors)
    return {"header": (0, 24), "metadata": (24, infos), "tensor infos": (infos, data),
            "data": (data, path.stat().st_size)}


GGUF_REGIONS = _gguf_regions(GGUF)


# one mutation: (region, cut, [(offset in the region, bytes written there)])
GGUF_MUTATIONS = st.tuples(st.sampled_from(sorted(GGUF_REGIONS)), st.booleans(),
                           st.lists(st.tuples(st.integers(0, 2**31), st.binary(min_size=1, max_size=8)),
                                    min_size=1, max_size=4))


def _mutated_gguf(region: str, cut: bool, patches: list[tuple[int, bytes]]) -> bytes:
    data = bytearray(GGUF.read_bytes())
    lo, hi = GGUF_REGIONS[region]
    if cut and region != "data":  # the file ends inside the region
        return bytes(data[: lo + patches[0][0] % (hi - lo)])
    for offset, patch in patches:
        at = lo + offset % (hi - lo)
        data[at: at + len(patch)] = patch
    return bytes(data)


@given(GGUF_MUTATIONS)
def test_fuzz_gguf_files(tmp_path_factory, mutation):
    folder = _scratch(tmp_path_factory, "gguf")
    path = folder / "tiny.gguf"
    path.write_bytes(_mutated_gguf(*mutation))

    def read():
        from specft.target_model import load_target

        cfg = root_cfg("model=hf", f"model.path={path}", "quant=checkpoint", "model.dtype=float32", AUX)
        load_target(cfg.model)

    takes_or_refuses("gguf", folder, read)


# -- quantized checkpoints: config.json, the family's own description, safetensors headers --

FAMILY_FIXTURES = {
    "gptq": (CHECKPOINTS / "tiny_qwen3_gptq_awq" / "gptq_autoround", "config.json"),
    "awq": (CHECKPOINTS / "tiny_qwen3_gptq_awq" / "awq_autoround", "config.json"),
    "compressed-tensors": (CHECKPOINTS / "tiny_qwen3" / "w8a8_int8_sq_gptq", "config.json"),
    "hf-fp8": (CHECKPOINTS / "tiny_qwen3_hf_fp8", "config.json"),
    "gpt-oss": (CHECKPOINTS / "tiny_gpt_oss_mxfp4", "config.json"),
    "modelopt": (CHECKPOINTS / "tiny_qwen3_modelopt" / "fp8", "hf_quant_config.json"),
    "msmodelslim": (CHECKPOINTS / "tiny_qwen3_msmodelslim" / "w8a8_dynamic", "quant_model_description.json"),
}


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    """The fixture without its oracle (not read by specft; big)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("oracle.safetensors", "*.yaml"))
    return dst


def _quant_config_doc(folder: Path, name: str) -> dict:
    doc = json.loads((folder / name).read_text())
    return doc


@pytest.mark.parametrize("family", sorted(FAMILY_FIXTURES))
@given(data=st.data())
def test_fuzz_quantization_configs(tmp_path_factory, family, data):
    src, name = FAMILY_FIXTURES[family]
    folder = _copy_checkpoint(src, _scratch(tmp_path_factory, family) / "ckpt")
    doc = _quant_config_doc(folder, name)
    # config.json: the quantization_config is what the family reads; the rest is the model's
    target = doc["quantization_config"] if name == "config.json" else doc
    mutated = data.draw(json_mutation(target))
    if name == "config.json":
        doc["quantization_config"] = mutated
    else:
        doc = mutated
    (folder / name).write_text(json.dumps(doc))
    takes_or_refuses(f"{family} {name}", folder, lambda: checkpoint_model(folder, "model.dtype=float32"))


def _safetensors_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8: 8 + size]), raw[8 + size:]


SAFETENSORS_DTYPES = ["F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8", "BOOL",
                      "F4", "XX"]


@st.composite
def safetensors_header_mutation(draw, header: dict):
    header = json.loads(json.dumps(header))
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    entry = header[name]
    action = draw(st.sampled_from(["dtype", "shape", "offsets", "drop", "rename"]))
    if action == "dtype":
        entry["dtype"] = draw(st.sampled_from(SAFETENSORS_DTYPES))
    elif action == "shape":
        entry["shape"] = draw(st.lists(st.integers(0, 300), max_size=4))
    elif action == "offsets":
        entry["data_offsets"] = sorted(draw(st.lists(st.integers(0, 2**20), min_size=2, max_size=2)))
    elif action == "drop":
        del header[name]
    else:
        header[name + draw(st.sampled_from(["_x", ".weight", "s"]))] = header.pop(name)
    return header


@pytest.mark.parametrize("family", ["gptq", "hf-fp8", "compressed-tensors"])
@given(data=st.data())
def test_fuzz_safetensors_headers(tmp_path_factory, family, data):
    src, _ = FAMILY_FIXTURES[family]
    folder = _copy_checkpoint(src, _scratch(tmp_path_factory, family) / "ckpt")
    (weights,) = [p for p in folder.glob("*.safetensors")]
    header, body = _safetensors_header(weights)
    encoded = json.dumps(data.draw(safetensors_header_mutation(header))).encode()
    weights.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)
    takes_or_refuses(f"{family} safetensors header", folder, lambda: checkpoint_model(folder, "model.dtype=float32"))


# -- a draft checkpoint's draft_config.json, a cache's manifest.json ------------------------


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory) -> Path:
    """A draft checkpoint as training writes one (its config and weights), for tiny_qwen3."""
    import dataclasses

    from specft.drafts import DRAFT_ARCHS, DraftHeadConfig

    out = tmp_path_factory.mktemp("draft") / "step-0000001"
    out.mkdir()
    config = DraftHeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                             target_vocab_size=256, draft_vocab_size=64)
    draft = DRAFT_ARCHS.get("eagle3").empty(config)
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(out / "draft.safetensors"))
    meta = {"architecture": "eagle3", **dataclasses.asdict(config)}
    (out / "draft_config.json").write_text(json.dumps(meta))
    return out


@given(data=st.data())
def test_fuzz_draft_configs(tmp_path_factory, draft_folder, data):
    from specft.eval.drafts import load_draft

    folder = Path(shutil.copytree(draft_folder, _scratch(tmp_path_factory, "draft") / "step-0000001"))
    meta = json.loads((folder / "draft_config.json").read_text())
    (folder / "draft_config.json").write_text(json.dumps(data.draw(json_mutation(meta))))
    takes_or_refuses("draft_config.json", folder, lambda: load_draft(folder))


@pytest.fixture(scope="module")
def cache_folder(tmp_path_factory) -> Path:
    from specft.cache import ensure_cache

    root = tmp_path_factory.mktemp("cache")
    return ensure_cache(root_cfg("model=tiny_qwen3", "data.num_samples=6", "cache.samples_per_shard=3",
                                 f"cache.root={root}"))


@given(data=st.data())
def test_fuzz_cache_manifests(tmp_path_factory, cache_folder, data):
    from specft.cache import CacheReader

    folder = Path(shutil.copytree(cache_folder, _scratch(tmp_path_factory, "cache") / cache_folder.name))
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(data.draw(json_mutation(manifest))))

    def read():
        reader = CacheReader(folder)
        for i in range(len(reader)):
            reader[i]

    takes_or_refuses("manifest.json", folder, read)



# -- rotation files (fold-rotation, trainer.unrotate), regeneration's answer stores ----------


@pytest.fixture(scope="module")
def rotation_file(tmp_path_factory) -> Path:
    """R1 as scripts/recover_rotation.py saves one: one orthogonal float32 matrix."""
    path = tmp_path_factory.mktemp("rotation") / "r1.safetensors"
    q, _ = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    save_file({"r1": q.float().contiguous()}, str(path))
    return path


@given(data=st.data())
def test_fuzz_rotation_files(tmp_path_factory, rotation_file, data):
    from specft.target_model.rotation_source import rotation_matrix

    folder = _scratch(tmp_path_factory, "rotation")
    path = folder / "r1.safetensors"
    header, body = _safetensors_header(rotation_file)
    if data.draw(st.booleans()):
        encoded = json.dumps(data.draw(safetensors_header_mutation(header))).encode()
        path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)
    else:  # the matrix's values: bytes overwritten (NaN, another matrix) or the file cut
        raw = bytearray(rotation_file.read_bytes())
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at: at + 8] = data.draw(st.binary(min_size=1, max_size=8))
        path.write_bytes(bytes(raw[: data.draw(st.integers(0, len(raw)))]))
    takes_or_refuses("rotation file", folder, lambda: rotation_matrix(str(path), 16, "--rotation"))


@given(lines=st.lists(st.one_of(JSON_VALUES.map(json.dumps), st.text(max_size=30),
                                st.builds(lambda i, m: json.dumps({"index": i, "messages": m}), JSON_VALUES,
                                          JSON_VALUES)), max_size=6))
def test_fuzz_answer_stores(tmp_path_factory, lines):
    """A store a killed or another run left: what it holds that is not a finished
    conversation is redone, never a traceback."""
    from specft.data.answer_store import load_store

    folder = _scratch(tmp_path_factory, "answers")
    (folder / "regenerated-r000.jsonl").write_text("\n".join(lines))

    def read():
        for index, messages in load_store(folder / "regenerated-r000.jsonl").items():
            assert isinstance(index, int) and all(isinstance(m["content"], str) for m in messages)

    takes_or_refuses("answer store", folder, read)

# -- an OpenAI-compatible server's replies, llama.cpp's probe outputs ----------------------

VALID_COMPLETION = {"object": "text_completion",
                    "choices": [{"index": 0, "text": "4", "finish_reason": "stop", "token_ids": [19]}]}
VALID_MODELS = {"object": "list", "data": [{"id": "fake", "object": "model"}]}


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from specft.target_model import load_tokenizer

    return load_tokenizer(root_cfg("model=tiny_qwen3").model)


@given(data=st.data())
def test_fuzz_server_replies(tmp_path_factory, tiny_tokenizer, data):
    from fake_openai_server import FakeOpenAiServer

    from specft.config import AnswerServerConfig, RegenerateConfig
    from specft.engines.openai_server import AnswerServer, check_tokens

    models = data.draw(st.one_of(st.just(VALID_MODELS), json_mutation(VALID_MODELS)))
    completion = data.draw(json_mutation(VALID_COMPLETION))
    raw = data.draw(st.one_of(st.none(), st.binary(max_size=40)))  # or bytes that are no JSON at all
    status = data.draw(st.sampled_from([200, 200, 200, 404, 500]))

    def reply(path, body):
        if path == "/v1/models":
            return 200, json.dumps(models).encode()
        return status, raw if raw is not None else json.dumps(completion).encode()

    folder = _scratch(tmp_path_factory, "server")
    with FakeOpenAiServer(reply) as server:
        client = AnswerServer(AnswerServerConfig(url=server.url, retries=0, connect_timeout_s=1800,
                                                 timeout_s=1800))  # hang bounds: the local server answers at once

        def read():  # as regeneration reads a reply: the server's identity, its answer, the ids' check
            client.identity()
            for answer in client.answer([[1, 2, 3]], RegenerateConfig(), 0):
                check_tokens(answer, tiny_tokenizer, "fuzz")

        takes_or_refuses("server reply", folder, read)


@given(data=st.data())
def test_fuzz_probe_outputs(tmp_path_factory, data):
    from specft.llamacpp.probe import read_results

    folder = _scratch(tmp_path_factory, "probe")
    meta = data.draw(st.one_of(json_mutation({"rows": [2], "n_embd": 4, "n_vocab": 8}), JSON_VALUES))
    (folder / "meta.json").write_text(json.dumps(meta))
    for name in ("logits.f32", "final.f32", "hidden.f32"):
        if data.draw(st.booleans()):
            (folder / name).write_bytes(data.draw(st.binary(max_size=256)))
    (folder / "tokens.txt").write_text(data.draw(st.text(max_size=20)))
    takes_or_refuses("probe output", folder, lambda: read_results(folder, "m.gguf", 1, (1,), True, True))


def teardown_module(module):
    if os.environ.get("SPECFT_FUZZ_PROFILE") == "fuzz":
        print("\nfuzz: inputs read per kind: " + ", ".join(f"{k} {v}" for k, v in sorted(TRIED.items())))
