"""`specft fold-rotation`: a 16-bit EAGLE-3 draft folded for a rotated target proposes, in
float64, what the original proposes on the original target."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specft.config import aux_layer_ids
from specft.decoding.engine import SpecDecoder
from specft.drafts import DRAFT_ARCHS, DraftHeadConfig
from specft.drafts.eagle3.model import Eagle3Draft
from specft.eval.drafts import load_draft, share_target_embedding
from specft.export.rotation_fold import fold_into_eagle3, recover_rotation
from specft.quant.orthogonal import orthogonal
from specft.quant.rotation import rotate_model
from specft.target_model import FeatureCapture
from specft.target_model.rotation_source import rotation_matrix
from specft.train.checkpoint import write_draft_files

from conftest import run_cli
from helpers import float64_target, model_cfg, quant_cfg

H, V = 64, 2048


@pytest.fixture(scope="module")
def targets():
    """(original, rotated as w8a8_int8_quarot rotates it, unquantized), float64."""
    model = float64_target("tiny_qwen3")
    rotated = copy.deepcopy(model)
    rotate_model(rotated, quant_cfg("w8a8_int8_quarot").rotation)
    return model, rotated


def _draft_checkpoint(folder, target):
    torch.manual_seed(0)
    c = DraftHeadConfig(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                        target_vocab_size=V, draft_vocab_size=512, target_hidden_size=H)
    draft = Eagle3Draft(c, target.get_input_embeddings().weight.detach(), torch.sort(torch.randperm(V)[:512]).values)
    for name, p in draft.named_parameters():
        if name != "embed_tokens.weight":  # norms too: their scales must be folded, not dropped
            p.data.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    folder.mkdir()
    write_draft_files(folder, draft, {"architecture": "eagle3", "target_model": "tiny_qwen3", "quant": "bf16",
                                      "aux_layer_ids": aux_layer_ids(model_cfg("tiny_qwen3")),
                                      "target_hidden_size": H}, "model:\n  num_layers: 8\n")
    return folder


def _draft_logits(draft, target, ids):
    aux, _ = FeatureCapture(target, aux_layer_ids(model_cfg("tiny_qwen3")))(ids, torch.ones_like(ids))
    share_target_embedding(draft, target)
    with torch.no_grad():
        return torch.stack(draft(ids, aux, None, steps=3).logits)


IDS = torch.randint(0, V, (2, 14), generator=torch.Generator().manual_seed(3))


def test_folded_draft_on_the_rotated_target_equals_the_original(tmp_path, targets):
    """Exact in float64: the fold of the float64 weights."""
    model, rotated = targets
    ckpt = _draft_checkpoint(tmp_path / "ckpt", model)
    original, meta = load_draft(ckpt, torch.float64)
    folded, _ = load_draft(ckpt, torch.float64)
    r1, _ = rotation_matrix("w8a8_int8_quarot", H)
    folded.load_state_dict(fold_into_eagle3(folded.state_dict(), meta, r1))
    ids = IDS
    want = _draft_logits(original, model, ids)
    got = _draft_logits(folded, rotated, ids)
    assert (got - want).abs().max() < 1e-10
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Unfolded, the same draft on the rotated target proposes other tokens (the collapse).
    stale, _ = load_draft(ckpt, torch.float64)
    moved = _draft_logits(stale, rotated, ids).argmax(-1)
    assert (moved == want.argmax(-1)).float().mean() < 0.5
    # In the decode loop: the same proposals, so the same acceptance at every position.
    runs = []
    for target, draft in ((model, original), (rotated, folded)):
        decoder = SpecDecoder(target, DRAFT_ARCHS.get("eagle3").runner(draft), aux_layer_ids(model_cfg("tiny_qwen3")),
                              eos_ids=set())
        res = decoder.generate([ids[0].tolist(), ids[1, :9].tolist()], k=3, max_new_tokens=12)
        runs.append((res.tokens, res.stats.proposed_at, res.stats.accepted_at))
    assert runs[0] == runs[1]


def test_fold_rotation_command_writes_a_checkpoint_eval_reads(tmp_path, targets):
    """The command folds the float32 checkpoint (float32 rounding of the folded weights)."""
    model, rotated = targets
    ckpt = _draft_checkpoint(tmp_path / "ckpt", model)
    proc = run_cli(["fold-rotation", str(ckpt), str(tmp_path / "folded"), "--rotation", "w8a8_int8_quarot"],
                   cwd=tmp_path)
    assert "folded the rotation" in proc.stdout
    folded, meta = load_draft(tmp_path / "folded", torch.float64)
    assert meta["rotation"] == {"quant": "w8a8_int8_quarot", "kind": "hadamard", "seed": 0}
    want = _draft_logits(load_draft(ckpt, torch.float64)[0], model, IDS)
    got = _draft_logits(folded, rotated, IDS)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_fold_reads_a_saved_matrix_and_refuses_bad_ones(tmp_path, targets):
    model, _ = targets
    ckpt = _draft_checkpoint(tmp_path / "ckpt", model)
    r1 = orthogonal("random", H, 4)
    save_file({"R1": r1.float()}, str(tmp_path / "r1.safetensors"))
    run_cli(["fold-rotation", str(ckpt), str(tmp_path / "a"), "--rotation", str(tmp_path / "r1.safetensors")],
            cwd=tmp_path)
    assert json.loads((tmp_path / "a" / "draft_config.json").read_text())["rotation"]["file"].endswith("r1.safetensors")
    save_file({"R1": torch.randn(H, H)}, str(tmp_path / "skew.safetensors"))
    save_file({"R1": torch.eye(32)}, str(tmp_path / "small.safetensors"))
    (tmp_path / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00not a header")  # was a SafetensorError traceback
    for source, message in (("w8a8_int8", "rotates no residual stream"),
                            (str(tmp_path / "skew.safetensors"), "is not orthogonal"),
                            (str(tmp_path / "small.safetensors"),
                             "holds a (32, 32) matrix; the draft's target is 64 wide"),
                            (str(tmp_path / "none.safetensors"), "no file"),
                            (str(tmp_path / "garbage.safetensors"), "is not a readable .safetensors file")):
        proc = run_cli(["fold-rotation", str(ckpt), str(tmp_path / "b"), "--rotation", source], cwd=tmp_path,
                       check=False)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "b" / "draft.safetensors").exists()
    proc = run_cli(["fold-rotation", str(tmp_path / "a"), str(tmp_path / "c"), "--rotation", "w8a8_int8_quarot"],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "already folded" in proc.stderr


def test_fold_reads_the_rotation_msmodelslim_saved_beside_its_checkpoint(tmp_path, targets):
    """`--rotation CKPT`: msModelSlim's QuaRot saves its R1 (optional/quarot.safetensors);
    a checkpoint that saves none is refused with the way out."""
    from test_msmodelslim_checkpoints import QUAROT
    from test_transform_checkpoints import FIXTURE as SPINQUANT

    from specft.quantized_checkpoints.msmodelslim import saved_rotation

    model, _ = targets
    ckpt = _draft_checkpoint(tmp_path / "ckpt", model)
    run_cli(["fold-rotation", str(ckpt), str(tmp_path / "a"), "--rotation", str(QUAROT)], cwd=tmp_path)
    meta = json.loads((tmp_path / "a" / "draft_config.json").read_text())
    assert meta["rotation"] == {"checkpoint": str(QUAROT)}
    state = load_file(str(ckpt / "draft.safetensors"))
    want = fold_into_eagle3(state, meta, saved_rotation(QUAROT).double())
    got = load_file(str(tmp_path / "a" / "draft.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want) and not torch.equal(got["fc.weight"], state["fc.weight"])
    for source, message in ((SPINQUANT, "is not a checkpoint that saves its rotation (msModelSlim QuaRot)"),
                            (QUAROT.parent / "w8a8_dynamic", "is not rotated")):
        proc = run_cli(["fold-rotation", str(ckpt), str(tmp_path / "b"), "--rotation", str(source)], cwd=tmp_path,
                       check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert not (tmp_path / "b").exists()


def test_rotation_is_recovered_from_the_two_checkpoints(targets):
    model, rotated = targets
    r, residual, centered = recover_rotation(model.get_input_embeddings().weight, rotated.get_input_embeddings().weight)
    assert residual < 1e-12 and not centered and (r - orthogonal("hadamard", H)).abs().max() < 1e-10
    # From float32 storage the recovery is as good as the storage (measured ~1e-7).
    r, residual, _ = recover_rotation(model.get_input_embeddings().weight.float(),
                                      rotated.get_input_embeddings().weight.float())
    assert residual < 1e-6 and (r - orthogonal("hadamard", H)).abs().max() < 1e-5


def test_rotation_is_recovered_from_llm_compressors_spinquant_checkpoint():
    """The real thing: llm-compressor centered the embedding, then rotated it by its
    Hadamard R1 (the fixture of tests/test_transform_checkpoints.py, made from this base).
    The centered embedding alone fits a rotation with either sign along the direction of
    the mean; the untied heads pin that sign."""
    from test_transform_checkpoints import FIXTURE

    model = float64_target("tiny_qwen3")
    rotated = load_file(str(FIXTURE / "model.safetensors"))
    base = model.get_input_embeddings().weight.float()
    r, residual, centered = recover_rotation(base, rotated["model.embed_tokens.weight"],
                                             model.lm_head.weight.float(), rotated["lm_head.weight"])
    assert centered and residual < 1e-6 and (r - orthogonal("hadamard", H)).abs().max() < 1e-6
    # Without the heads the fit is as good, but the mean's direction is the SVD's choice:
    # R agrees with R1 on every vector orthogonal to the mean.
    alone, residual, _ = recover_rotation(base, rotated["model.embed_tokens.weight"])
    off_mean = torch.eye(H, dtype=torch.float64) - torch.full((H, H), 1.0 / H, dtype=torch.float64)
    assert residual < 1e-6 and (off_mean @ (alone - orthogonal("hadamard", H))).abs().max() < 1e-6
