"""`specft export`: layouts pinned against the engines' documented names, and a round
trip through a small independent reader (safetensors + json only) to identical logits."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specft.drafts import DraftHeadConfig, Eagle3Draft, MtpDraft
from specft.drafts.qat import apply_draft_qat
from specft.eval.drafts import load_draft
from specft.quant.config import QuantConfig, load_quant_config
from specft.quant.fake_quant import TensorQuantSpec, fake_quant
from specft.train.checkpoint import write_draft_files

from conftest import run_cli

H, V, VD, LAYERS = 64, 96, 48, 6
AUX = [1, 2, 3]


def _checkpoint(tmp_path, arch="eagle3", draft_quant=None, full_vocab=False, qk_norm=False, verifier=None):
    torch.manual_seed(0)
    vd = V if full_vocab else VD
    c = DraftHeadConfig(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                     target_vocab_size=V, draft_vocab_size=vd, num_layers=2 if arch == "eagle3" else 1,
                     target_hidden_size=H, qk_norm=qk_norm)
    d2t = torch.arange(V) if full_vocab else torch.sort(torch.randperm(V)[:VD]).values
    emb, head = torch.randn(V, H), torch.randn(V, H)
    draft = Eagle3Draft(c, emb, d2t) if arch == "eagle3" else MtpDraft(c, emb, d2t, head[d2t])
    for p in draft.parameters():
        p.data.normal_(0, 0.2)
    if draft_quant:
        apply_draft_qat(draft, load_quant_config(draft_quant))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    extra = {"architecture": arch, "target_model": "tiny", "quant": "mxfp4", "draft_quant": draft_quant,
             "aux_layer_ids": AUX, "target_hidden_size": H, **({"verifier": verifier} if verifier else {})}
    write_draft_files(folder, draft, extra, f"model:\n  num_layers: {LAYERS}\n")
    return folder, head


# -- the independent reader --------------------------------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def read_export(folder):
    """(config dict, {name: float tensor}) with quantized weights dequantized by hand."""
    config = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for name, t in raw.items():
        if name.endswith(".weight_packed"):
            codes = torch.stack([t & 0xF, t >> 4], -1).reshape(t.shape[0], -1).long()
            values = E2M1[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
            scale = torch.exp2(raw[name.replace("weight_packed", "weight_scale")].float() - 127)
            out[name.replace("weight_packed", "weight")] = \
                (values.view(t.shape[0], -1, 32) * scale[..., None]).reshape(t.shape[0], -1)
        elif name.endswith(".weight_scale"):
            continue
        elif t.dtype == torch.float8_e4m3fn:
            out[name] = t.float() * raw[name + "_scale"].float()
        else:
            out[name] = t
    return config, out


def rebuild_eagle3(config, tensors):
    c = DraftHeadConfig(hidden_size=config["hidden_size"], num_heads=config["num_attention_heads"],
                     num_kv_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
                     intermediate_size=config["intermediate_size"], target_vocab_size=config["vocab_size"],
                     draft_vocab_size=config["draft_vocab_size"], rms_norm_eps=config["rms_norm_eps"],
                     rope_theta=config["rope_theta"], num_layers=config["num_hidden_layers"],
                     target_hidden_size=config["target_hidden_size"], qk_norm=config["model_type"] == "qwen3")
    d2t = tensors["d2t"] + torch.arange(c.draft_vocab_size)
    draft = Eagle3Draft(c, torch.zeros(c.target_vocab_size, c.hidden_size), d2t)
    state = {}
    for name, t in tensors.items():
        if name.startswith("layers."):
            index, rest = name[len("layers."):].split(".", 1)
            name = f"extra_layers.{int(index) - 1}.{rest}"
        state[name] = t.float() if t.is_floating_point() else t
    return draft, state


def rebuild_mtp(config, tensors, layers):
    prefix = f"model.layers.{layers}."
    c = DraftHeadConfig(hidden_size=config["hidden_size"], num_heads=config["num_attention_heads"],
                     num_kv_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
                     intermediate_size=config["intermediate_size"], target_vocab_size=config["vocab_size"],
                     draft_vocab_size=config["vocab_size"], rms_norm_eps=config["rms_norm_eps"])
    head = tensors[prefix + "shared_head.head.weight"].float()
    draft = MtpDraft(c, torch.zeros(c.target_vocab_size, c.hidden_size), torch.arange(c.target_vocab_size), head)
    own = ("enorm.", "hnorm.", "eh_proj.", "embed_tokens.", "shared_head.")
    state = {}
    for name, t in tensors.items():
        name = name[len(prefix):]
        if name == "shared_head.head.weight":
            continue
        state[name if name.startswith(own) else "block." + name] = t.float()
    return draft, state


def _inputs():
    g = torch.Generator().manual_seed(3)
    return (torch.randint(0, V, (2, 10), generator=g), torch.randn(2, 10, 3 * H, generator=g),
            torch.randn(2, 10, H, generator=g))


def _activation_only(qcfg_name):
    q = load_quant_config(qcfg_name)
    return QuantConfig(name=q.name, weight=None, activation=q.activation, exclude=q.exclude)


@pytest.mark.parametrize("draft_quant,qk_norm", [(None, False), ("fp8", False), ("mxfp4", False), (None, True)])
def test_eagle3_round_trip_gives_identical_logits(tmp_path, draft_quant, qk_norm):
    folder, _ = _checkpoint(tmp_path, draft_quant=draft_quant, qk_norm=qk_norm)
    out = tmp_path / "export"
    run_cli(["export", str(folder), str(out), "--dtype", "float32"], cwd=tmp_path)
    config, tensors = read_export(out)
    draft, state = rebuild_eagle3(config, tensors)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    assert set(missing) == {"embed_tokens.weight", "draft_to_target"} and not unexpected
    ref, _ = load_draft(folder)
    draft.embed_tokens.weight.data.copy_(ref.embed_tokens.weight)  # shared with the target at serving time
    if draft_quant:
        apply_draft_qat(draft, _activation_only(draft_quant))  # weights are already the dequantized ones
    with torch.no_grad():
        a, b = ref(*_inputs(), steps=3), draft(*_inputs(), steps=3)
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y)


def test_bf16_export_is_the_checkpoint_rounded_once(tmp_path):
    folder, _ = _checkpoint(tmp_path)
    out = tmp_path / "export"
    run_cli(["export", str(folder), str(out)], cwd=tmp_path)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        fc = f.get_tensor("fc.weight")
    ref, _ = load_draft(folder)
    assert fc.dtype == torch.bfloat16 and torch.equal(fc, ref.fc.weight.to(torch.bfloat16))


def test_eagle3_layout_names_shapes_and_dtypes(tmp_path):
    folder, _ = _checkpoint(tmp_path, draft_quant="mxfp4")
    out = tmp_path / "export"
    run_cli(["export", str(folder), str(out)], cwd=tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == VD and config["vocab_size"] == V and config["target_hidden_size"] == H
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in AUX]  # vLLM counts layer inputs
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mxfp4-pack-quantized"
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    expected = {
        "fc.weight_packed": ((H, 3 * H // 2), "U8"), "fc.weight_scale": ((H, 3 * H // 32), "U8"),
        "midlayer.self_attn.q_proj.weight_packed": ((64, 2 * H // 2), "U8"),
        "midlayer.self_attn.k_proj.weight_scale": ((32, 2 * H // 32), "U8"),
        "midlayer.mlp.down_proj.weight_packed": ((H, 128 // 2), "U8"),
        "midlayer.input_layernorm.weight": ((H,), "BF16"), "midlayer.hidden_norm.weight": ((H,), "BF16"),
        "layers.1.mlp.up_proj.weight_packed": ((128, H // 2), "U8"),
        "norm.weight": ((H,), "BF16"), "lm_head.weight": ((VD, H), "BF16"),
        "d2t": ((VD,), "I64"), "t2d": ((V,), "BOOL"),
    }
    for name, want in expected.items():
        assert shapes[name] == want, name
    assert not any(k.startswith(("embed_tokens", "extra_layers", "draft_to_target")) for k in shapes)
    assert "lm_head" in q["ignore"]


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_a_draft_over_the_whole_vocabulary_writes_no_id_map(tmp_path, layout):
    """vLLM builds no d2t parameter when the draft's vocabulary is the target's and
    refuses a checkpoint that has one (found by scripts/checks/check_vllm.py)."""
    folder, _ = _checkpoint(tmp_path, full_vocab=True)
    out = tmp_path / "export"
    run_cli(["export", str(folder), str(out), "--layout", layout], cwd=tmp_path)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not names & {"d2t", "t2d"} and "lm_head.weight" in names
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == V


def test_fp8_layout_and_speculators_config(tmp_path):
    folder, _ = _checkpoint(tmp_path, draft_quant="fp8")
    out = tmp_path / "export"
    run_cli(["export", str(folder), str(out), "--layout", "speculators"], cwd=tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_config"]["algorithm"] == "eagle3"
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert config["quantization_config"]["format"] == "float-quantized"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("fc.weight").get_dtype() == "F8_E4M3"
        assert tuple(f.get_slice("fc.weight_scale").get_shape()) == (H, 1)
        assert f.get_slice("fc.weight_scale").get_dtype() == "F32"
        names = set(f.keys())
    assert "layers.0.self_attn.q_proj.weight" in names and "layers.1.mlp.up_proj.weight" in names
    assert not any(n.startswith("midlayer.") for n in names)


def test_qwen3_layer_exports_in_both_layouts_with_its_verifier(tmp_path):
    verifier = {"name_or_path": "/models/qwen3", "architectures": ["Qwen3ForCausalLM"],
                "max_position_embeddings": 8192, "family": "qwen3"}
    folder, _ = _checkpoint(tmp_path, qk_norm=True, verifier=verifier)
    run_cli(["export", str(folder), str(tmp_path / "e"), "--dtype", "float32"], cwd=tmp_path)
    config, tensors = read_export(tmp_path / "e")
    assert config["architectures"] == ["Eagle3Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["max_position_embeddings"] == 8192 and config["attention_bias"] is False
    assert "layers.1.self_attn.k_norm.weight" in tensors  # the round trip above checks the values

    run_cli(["export", str(folder), str(tmp_path / "s"), "--layout", "speculators"], cwd=tmp_path)
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"] == {"name_or_path": "/models/qwen3",
                                                      "architectures": ["Qwen3ForCausalLM"]}
    layer = spec["transformer_layer_config"]
    assert layer["architectures"] == ["Qwen3ForCausalLM"] and layer["model_type"] == "qwen3"
    assert layer["max_position_embeddings"] == 8192


def test_mtp_round_trip_and_deepseek_names(tmp_path):
    folder, _ = _checkpoint(tmp_path, arch="mtp", full_vocab=True)
    out = tmp_path / "export"
    run_cli(["export", str(folder), str(out), "--layout", "mtp", "--dtype", "float32"], cwd=tmp_path)
    config, tensors = read_export(out)
    assert config["num_nextn_predict_layers"] == 1
    p = f"model.layers.{LAYERS}."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "embed_tokens.weight",
                 "shared_head.norm.weight", "shared_head.head.weight", "input_layernorm.weight",
                 "self_attn.q_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight"):
        assert p + name in tensors, name
    draft, state = rebuild_mtp(config, tensors, LAYERS)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    assert set(missing) <= {"draft_to_target", "d2t", "t2d", "head_weight"} and not unexpected
    ref, _ = load_draft(folder)
    with torch.no_grad():
        a, b = ref(*_inputs(), steps=2), draft(*_inputs(), steps=2)
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y)



def test_mtp_with_a_reduced_vocab_takes_the_targets_full_head(tmp_path):
    from safetensors.torch import save_file

    folder, head = _checkpoint(tmp_path, arch="mtp")
    bad = run_cli(["export", str(folder), str(tmp_path / "x"), "--layout", "mtp"], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "--target-head" in bad.stderr  # one clear line, nothing written
    save_file({"lm_head": head}, str(tmp_path / "target_head.safetensors"))
    run_cli(["export", str(folder), str(tmp_path / "x"), "--layout", "mtp", "--dtype", "float32",
             "--target-head", str(tmp_path / "target_head.safetensors")], cwd=tmp_path)
    _, tensors = read_export(tmp_path / "x")
    assert torch.equal(tensors[f"model.layers.{LAYERS}.shared_head.head.weight"], head)


def test_layout_must_fit_the_architecture(tmp_path):
    folder, _ = _checkpoint(tmp_path)
    bad = run_cli(["export", str(folder), str(tmp_path / "x"), "--layout", "mtp"], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: --layout mtp")


def test_dequantized_export_equals_fake_quant():
    from specft.export.packing import pack_mxfp4

    w = torch.randn(8, 64) * torch.logspace(-3, 2, 64)
    spec = TensorQuantSpec(format="e2m1", scheme="mx", block_size=32, scale_rule="floor")
    packed = pack_mxfp4(w, spec)
    t = packed["weight_packed"]
    codes = torch.stack([t & 0xF, t >> 4], -1).reshape(8, -1).long()
    values = E2M1[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
    deq = (values.view(8, 2, 32) * torch.exp2(packed["weight_scale"].float() - 127)[..., None]).reshape(8, 64)
    assert torch.equal(deq, fake_quant(w, spec))


def test_export_takes_a_run_that_is_still_training(tmp_path):
    """A run with no final checkpoint yet: the run dir, its checkpoints/ folder and its
    latest file all lead to the step that latest names; final wins once it exists."""
    folder, _ = _checkpoint(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    older, newer = run / "checkpoints" / "step-0000050", run / "checkpoints" / "step-0000100"
    for step in (older, newer):
        step.mkdir()
        for name in ("draft.safetensors", "draft_config.json", "config.yaml"):
            (step / name).write_bytes((folder / name).read_bytes())
    (run / "checkpoints" / "latest").write_text("step-0000100")
    for given in (run, run / "checkpoints", run / "checkpoints" / "latest"):
        out = tmp_path / f"out-{given.name}"
        run_cli(["export", str(given), str(out)], cwd=tmp_path)
        config = json.loads((out / "config.json").read_text())
        assert config["specft"]["source_checkpoint"] == str(newer.resolve()), given
    (run / "checkpoints" / "final").mkdir()
    for name in ("draft.safetensors", "draft_config.json", "config.yaml"):
        (run / "checkpoints" / "final" / name).write_bytes((folder / name).read_bytes())
    run_cli(["export", str(run), str(tmp_path / "out-final")], cwd=tmp_path)
    config = json.loads((tmp_path / "out-final" / "config.json").read_text())
    assert config["specft"]["source_checkpoint"] == str((run / "checkpoints" / "final").resolve())


def test_a_latest_pointer_to_a_missing_step_is_one_line(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-0000100")
    out = run_cli(["export", str(run), str(tmp_path / "out")], cwd=tmp_path, check=False)
    assert out.returncode == 2 and "no draft checkpoint" in out.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, line", [
    (["--layout", "gguf", "--gguf-type", "q4_k"], "--gguf-type: llama.cpp loads a specft draft written as"),
    (["--gguf-type", "q8_0"], "--gguf-type q8_0: only --layout gguf writes GGUF weights"),
    (["--gguf-vocab", "none"], "--gguf-vocab none: only --layout gguf writes a GGUF vocabulary"),
])
def test_a_draft_gguf_type_llamacpp_cannot_load_is_one_line_and_nothing_is_written(tmp_path, args, line):
    folder, _ = _checkpoint(tmp_path)
    out = run_cli(["export", str(folder), str(tmp_path / "out"), *args], cwd=tmp_path, check=False)
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and line in errors[0], out.stderr
    assert not (tmp_path / "out").exists()


def test_every_layout_is_registered_with_its_writer_and_the_command_offers_each():
    """gguf is a layout like the others: the command lists every registered layout, each
    names a writer, and each architecture llama.cpp takes is a registered draft."""
    from specft.drafts import DRAFT_ARCHS
    from specft.drafts.layouts import LAYOUTS, LLAMACPP_DRAFTS
    from specft.export.writers import WRITERS

    assert {"eagle3", "speculators", "mtp", "peagle", "dflash", "gguf"} <= set(LAYOUTS.names)
    assert all(LAYOUTS.get(name).writer in WRITERS for name in LAYOUTS.names)
    assert set(LLAMACPP_DRAFTS.names) == {"eagle3", "dflash"} and set(LLAMACPP_DRAFTS.names) <= set(DRAFT_ARCHS.names)
    for name in LLAMACPP_DRAFTS.names:  # the converter reads a safetensors layout the draft carries
        assert LLAMACPP_DRAFTS.get(name).hf_layout in DRAFT_ARCHS.get(name).layouts
    usage = run_cli(["export", "--help"], cwd=Path.cwd()).stdout
    assert all(name in usage for name in LAYOUTS.names)


def test_a_draft_llamacpp_cannot_take_is_refused_by_its_own_folder():
    """Each draft folder's refusal for llama.cpp, as the gguf writer asks it."""
    from specft.drafts.layouts import LLAMACPP_DRAFTS

    assert "draft.qk_norm=false" in LLAMACPP_DRAFTS.get("eagle3").refusal({"qk_norm": True})
    assert LLAMACPP_DRAFTS.get("eagle3").refusal({"qk_norm": False}) is None
    narrow = {"target_vocab_size": 100, "draft_vocab_size": 50, "hidden_size": 8, "target_hidden_size": 8}
    assert "draft.vocab_size=100" in LLAMACPP_DRAFTS.get("dflash").refusal(narrow)
    assert LLAMACPP_DRAFTS.get("dflash").refusal({**narrow, "draft_vocab_size": 100}) is None
