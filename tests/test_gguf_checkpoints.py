"""GGUF targets (`model.path=FILE.gguf quant=checkpoint`) against llama.cpp's own numbers.

The fixtures (scripts/fixtures/make_gguf_fixtures.py) are a tiny random Qwen3 quantized by
llama-quantize into Q8_0, Q4_1 and Q4_K_M, with llama.cpp's logits and layer inputs as the
oracle. None of this needs llama.cpp installed; tests/test_llamacpp.py does.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specft.common.errors import SpecftError
from specft.quantized_checkpoints import open_checkpoint
from specft.quantized_checkpoints.ggml_activations import bf16, f16, q8_0

from helpers import checkpoint_model, root_cfg

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints" / "tiny_qwen3_gguf"
# every fixture llama-quantize made (made.json): Q8_0, Q4_1, Q4_K_M, MXFP4 and NVFP4 as dense
# models, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S
TYPES = tuple(json.loads((FIXTURES / "made.json").read_text())["types"])
# the tiny model has 3 layers; the default EAGLE-3 taps (1, N/2-1, N-4) need more
AUX = "model.aux_layer_ids=[0,1,2]"


def gguf_file(kind: str):
    return FIXTURES / kind / f"tiny-{kind}.gguf"


def _layer_errors(model, oracle) -> list[float]:
    """Mean |specft - llama.cpp| of each layer's input, then of the logits (last rows)."""
    rows = oracle["logits"].shape[1]
    with torch.no_grad():
        out = model(oracle["input_ids"], output_hidden_states=True)
    errors = [(out.hidden_states[i][:, -rows:] - oracle["layer_inputs"][:, :, i]).abs().mean().item()
              for i in range(oracle["layer_inputs"].shape[2])]
    return errors + [(out.logits[:, -rows:] - oracle["logits"]).abs().mean().item()]


@pytest.mark.parametrize("kind", TYPES)
def test_a_gguf_runs_closer_to_llamacpp_with_ggmls_activation_rounding(kind):
    """The weights are exact (the embedding row llama.cpp looks up is the one specft
    dequantizes), and rounding each linear input as ggml does for that weight type brings
    every later layer and the logits closer to llama.cpp than float inputs do. Not bit
    equal: float sums in another order flip a dynamic code on a rounding edge now and then.
    Measured on this fixture (AMD EPYC, AVX-512), mean error emulated / float: layer 1
    0.12 (Q8_0), 0.22 (Q4_1), 0.02 (Q4_K_M); logits 0.60, 0.59, 0.44 (the other types:
    docs/checkpoints.md)."""
    from specft.target_model import load_target

    oracle = load_file(str(FIXTURES / kind / "oracle.safetensors"))
    emulated, _, _ = checkpoint_model(gguf_file(kind), AUX)
    # the same weights without apply_quant: float activations, float32 KV
    cfg = root_cfg("model=hf", f"model.path={gguf_file(kind)}", "quant=checkpoint", "model.dtype=float32", AUX)
    plain, _ = load_target(cfg.model)
    ours, floats = _layer_errors(emulated, oracle), _layer_errors(plain.eval(), oracle)
    assert ours[0] == 0.0 == floats[0]
    for layer in range(1, len(ours) - 1):
        assert ours[layer] < 0.5 * floats[layer], (layer, ours, floats)
    assert ours[-1] < 0.8 * floats[-1], (ours, floats)


def test_the_gguf_header_gives_the_architecture():
    """transformers maps no head width from a GGUF (a Qwen3 would get 128); the header's
    key_length is used. Facts and the model come from the header alone."""
    from specft.target_model.facts import checkpoint_facts

    ckpt = open_checkpoint(gguf_file("Q8_0"))
    config = ckpt.load_config()
    made = json.loads((FIXTURES / "made.json").read_text())["shape"]
    assert (config.head_dim, config.num_hidden_layers, config.hidden_size, config.vocab_size) == \
        (made["head_dim"], made["num_layers"], made["hidden_size"], made["vocab_size"])
    facts = checkpoint_facts(gguf_file("Q8_0"))
    assert facts["head_dim"] == made["head_dim"] and facts["num_layers"] == made["num_layers"]


def test_each_weight_type_gets_its_ggml_activation_type():
    _, _, report = checkpoint_model(gguf_file("Q4_K_M"), AUX)
    ckpt = open_checkpoint(gguf_file("Q4_K_M"))
    kinds = {ckpt.tensor_types[f"blk.0.{t}.weight"] for t in ("attn_q", "ffn_down")}
    assert kinds <= {"Q4_K", "Q5_K", "Q6_K"}, kinds  # llama-quantize's Q4_K_M mix
    text = json.dumps(report, default=str)
    assert "ggml Q8_K" in text and "ggml Q8_0" not in text
    _, _, report = checkpoint_model(gguf_file("Q4_1"), AUX)
    assert "ggml Q8_1" in json.dumps(report, default=str)


def test_activation_rounding_equals_gguf_pys_reference_quantizers():
    """gguf-py's numpy quantizers are llama.cpp's Python reference (its Q8_0, F16 and BF16
    from_float); tests/test_llamacpp.py checks Q8_0, Q8_1 and Q8_K against libggml itself."""
    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((32, 512)) * rng.exponential(1, (32, 512))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    for kind, ours in ((gguf.GGMLQuantizationType.Q8_0, q8_0), (gguf.GGMLQuantizationType.F16, f16),
                       (gguf.GGMLQuantizationType.BF16, bf16)):
        reference = dequantize(quantize(x, kind), kind)
        assert np.array_equal(ours(torch.from_numpy(x)).numpy(), reference), kind.name


# -- refusals: one line, nothing written ------------------------------------------------------

def _tiny_gguf(path, arch="llama", tensor="blk.0.attn_q.weight", shape=(4, 32), kind=None):
    """A GGUF header with one tensor (gguf-py's writer), enough for open_checkpoint: float,
    or quantized to ``kind`` by gguf-py's own quantizer."""
    import gguf
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(4)])
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    if kind is None:
        writer.add_tensor(tensor, data)
    else:
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(tensor, quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_architecture_is_refused(tmp_path):
    with pytest.raises(SpecftError, match="is a GGUF of architecture gpt2; specft runs llama, qwen3"):
        open_checkpoint(_tiny_gguf(tmp_path / "m.gguf", arch="gpt2"))


def test_a_gguf_type_without_its_activation_path_is_refused(tmp_path, monkeypatch):
    from specft.quantized_checkpoints import ggml_activations, gguf_family

    supported = {k: v for k, v in ggml_activations.VEC_DOT_TYPE.items() if k != "Q8_0"}
    monkeypatch.setattr(gguf_family, "VEC_DOT_TYPE", supported)
    with pytest.raises(SpecftError,
                       match=r"\.weight is Q8_0, a GGUF type specft cannot run exactly as llama\.cpp does"):
        open_checkpoint(gguf_file("Q8_0"))


def test_an_expert_tensor_is_refused(tmp_path):
    path = _tiny_gguf(tmp_path / "moe.gguf", arch="qwen3", tensor="blk.0.ffn_gate_exps.weight", shape=(2, 4, 32))
    with pytest.raises(SpecftError, match="Mixture-of-Experts GGUFs are not supported yet"):
        open_checkpoint(path)


@pytest.mark.parametrize("arch", ["gpt-oss", "qwen3moe"])
def test_an_mxfp4_gguf_of_a_layout_specft_does_not_run_is_refused(tmp_path, arch):
    """The MXFP4 GGUFs people download are Mixture-of-Experts models (gpt-oss, llama-quantize's
    MXFP4_MOE): one line naming the architecture, before anything is loaded."""
    path = _tiny_gguf(tmp_path / "m.gguf", arch=arch, tensor="blk.0.ffn_gate_exps.weight", shape=(2, 4, 64),
                      kind="MXFP4")
    with pytest.raises(SpecftError, match=f"is a GGUF of architecture {arch}; specft runs llama, qwen3"):
        open_checkpoint(path)


def test_mxfp4_experts_in_a_dense_architecture_are_refused(tmp_path):
    path = _tiny_gguf(tmp_path / "moe.gguf", arch="qwen3", tensor="blk.0.ffn_up_exps.weight", shape=(2, 4, 64),
                      kind="MXFP4")
    with pytest.raises(SpecftError, match="Mixture-of-Experts GGUFs are not supported yet, MXFP4_MOE ones included"):
        open_checkpoint(path)


def test_a_dense_mxfp4_tensor_opens_with_ggmls_q8_0_activations(tmp_path):
    path = _tiny_gguf(tmp_path / "dense.gguf", arch="qwen3", tensor="blk.0.attn_q.weight", shape=(4, 64),
                      kind="MXFP4")
    ckpt = open_checkpoint(path)
    assert ckpt.tensor_types["blk.0.attn_q.weight"] == "MXFP4" and "MXFP4 weights" in ckpt.summary


def test_an_iq4_xs_token_embedding_is_refused_naming_the_fix(tmp_path):
    """After an IQ4_XS token embedding llama.cpp's layers part from specft's (measured, cause
    not found: gguf_family.UNMATCHED_EMBEDDINGS); one line, with the requantization that
    runs (the IQ4_XS fixture is made that way and agrees)."""
    import gguf

    path = tmp_path / "iq4xs.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(4)])
    # 4 rows of one 256-wide IQ4_XS block (136 bytes): zeros are a valid block (scale 0)
    writer.add_tensor("token_embd.weight", np.zeros((4, 136), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.IQ4_XS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SpecftError, match="its token embedding is IQ4_XS.*--token-embedding-type q8_0"):
        open_checkpoint(path)
    assert open_checkpoint(gguf_file("IQ4_XS")).tensor_types["token_embd.weight"] == "Q8_0"


def test_a_folder_of_several_ggufs_and_a_damaged_file_are_refused(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(gguf_file("Q8_0").read_bytes()[:4096])
    with pytest.raises(SpecftError, match="holds 2 .gguf files; give model.path=FILE.gguf"):
        open_checkpoint(tmp_path)
    (tmp_path / "c.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(SpecftError, match="is not a readable GGUF file"):
        open_checkpoint(tmp_path / "c.gguf")


def _header_only_gguf(path, arch, tokens: int | None, rows: int):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if tokens is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"t{i}" for i in range(tokens)])
    writer.add_tensor("token_embd.weight", np.zeros((rows, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch, tokens, rows, line", [
    ("gemma3", 4, 4, "is a GGUF of architecture gemma3; specft runs llama, qwen3"),  # was transformers' KeyError
    ("qwen3", None, 4, "holds no tokenizer (no tokenizer.ggml.tokens)"),  # was transformers' ValueError
    ("qwen3", 4, 6, "tokenizer lists 4 tokens and its embedding has 6 rows"),  # was a size mismatch, after writing
])
def test_a_gguf_specft_cannot_run_is_one_line_before_anything_is_written(tmp_path, arch, tokens, rows, line):
    """The header is checked before transformers' GGUF reader or the loader sees the file."""
    from conftest import run_cli

    bad = _header_only_gguf(tmp_path / "m.gguf", arch, tokens, rows)
    out = run_cli(["train", "model=hf", f"model.path={bad}", "quant=checkpoint"], cwd=tmp_path, check=False)
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and line in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_folder_of_ggufs_given_as_a_checkpoint_directory_names_the_gguf(tmp_path):
    from conftest import run_cli

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tiny-Q8_0.gguf").write_bytes(gguf_file("Q8_0").read_bytes())
    out = run_cli(["train", "model=hf", f"model.path={folder}"], cwd=tmp_path, check=False)
    assert out.returncode == 2 and "holds no config.json but 1 .gguf file(s) (tiny-Q8_0.gguf)" in out.stderr
    assert "model.path=" in out.stderr and "quant=checkpoint" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_the_cli_refuses_a_damaged_gguf_in_one_line(tmp_path):
    from conftest import run_cli

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 12)
    out = run_cli(["train", "model=hf", f"model.path={bad}", "quant=checkpoint"], cwd=tmp_path, check=False)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "GGUF" in lines[0], out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]



@pytest.mark.parametrize("kind", ["Q8_0", "MXFP4"])
def test_a_gguf_whose_scales_are_nan_is_refused_at_load_naming_the_tensor(tmp_path, kind):
    """A NaN block scale is a damaged file (#63): named at load, not blamed on an overflow
    once stage 1's hidden states turn non-finite."""
    import gguf

    from specft.target_model import load_target

    damaged = tmp_path / f"tiny-{kind}.gguf"
    damaged.write_bytes(gguf_file(kind).read_bytes())
    tensor = next(t for t in gguf.GGUFReader(str(damaged)).tensors if t.name == "blk.1.attn_q.weight")
    with open(damaged, "r+b") as f:  # the first block's scale: Q8_0's f16 d, MXFP4's E8M0 byte
        f.seek(tensor.data_offset)
        f.write(b"\x00\x7e" if kind == "Q8_0" else b"\xff")
    cfg = root_cfg("model=hf", f"model.path={damaged}", "quant=checkpoint", "model.dtype=float32", AUX)
    with pytest.raises(SpecftError, match=r"model.layers.1.self_attn.q_proj.weight in the checkpoint at .* holds "
                                          r"\d+ non-finite values \(NaN/Inf\) once dequantized; the file is damaged"):
        load_target(cfg.model)


# -- the user's path: train on the GGUF, eval ------------------------------------------------

def test_train_and_eval_against_a_gguf(tmp_path):
    from conftest import run_cli

    target = ["model=hf", f"model.path={gguf_file('Q4_K_M')}", "quant=checkpoint", AUX]
    run_cli(["train", *target, "draft.qk_norm=false", "data.num_samples=8", "trainer.max_steps=2",
             "hydra.run.dir=runs/ours"], cwd=tmp_path)
    ours = tmp_path / "runs" / "ours"
    config = json.loads((ours / "checkpoints" / "final" / "draft_config.json").read_text())
    assert config["quant"] == "checkpoint" and config["target_hidden_size"] == 256
    run_cli(["eval", *target, f"eval.drafts=[{ours}]", "eval.k=[2]", "eval.num_prompts=2",
             "eval.max_new_tokens=6", f"eval.out_dir={tmp_path / 'eval'}"], cwd=tmp_path)
    rows = json.loads((tmp_path / "eval" / "results.json").read_text())["results"]
    assert any(r["draft"] != "target alone" and r["proposed"] > 0 for r in rows), rows
