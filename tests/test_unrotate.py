"""trainer.unrotate: on a rotated target, stage 2 reads features, embedding and head
un-rotated (exactly the unrotated target's in float64), trains as it would on the 16-bit
target's basis, and writes drafts with R1 folded in."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from specft.common.errors import ConfigError
from specft.config import aux_layer_ids
from specft.export.rotation_fold import fold_into_eagle3
from specft.quant.rotation import rotate_model
from specft.target_model import FeatureCapture
from specft.target_model.rotation_source import rotation_matrix, served_rotation
from specft.train.unrotate import UnrotatedFeatures

from conftest import run_cli
from helpers import float64_target, model_cfg, quant_cfg, root_cfg

IDS = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(5))


class _Reader:
    """A feature reader over one target's forward (CacheReader's interface)."""

    def __init__(self, target):
        aux, final = FeatureCapture(target, aux_layer_ids(model_cfg("tiny_qwen3")))(IDS, torch.ones_like(IDS))
        self.samples = [{"input_ids": IDS[i], "aux_hidden": aux[i], "final_hidden": final[i]} for i in range(2)]
        self.embedding = target.get_input_embeddings().weight.detach()
        self.head = target.get_output_embeddings().weight.detach()
        self.manifest = {"aux_layer_ids": [1, 2, 3]}

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]

    def for_epoch(self, epoch):
        return self

    def target_embedding(self):
        return self.embedding

    def target_head_rows(self, start, stop):
        return self.head[start:stop]

    def target_head_rows_at(self, ids):
        return self.head[ids]


def test_unrotated_features_are_the_unrotated_targets_in_float64():
    model = float64_target("tiny_qwen3")
    rotated = copy.deepcopy(model)
    rotate_model(rotated, quant_cfg("w8a8_int8_quarot").rotation)
    r1, record = served_rotation(root_cfg("model=tiny_qwen3", "quant=w8a8_int8_quarot", "trainer.unrotate=target"))
    assert record == {"quant": "w8a8_int8_quarot", "kind": "hadamard", "seed": 0}
    want, seen = _Reader(model), _Reader(rotated)
    got = UnrotatedFeatures(seen, r1)
    for i in range(2):
        assert (got[i]["aux_hidden"] - want[i]["aux_hidden"]).abs().max() < 1e-10
        # The final norm's scale is fused into the rotated head: the logits are what agree.
        logits = got[i]["final_hidden"] @ got.target_head_rows(0, 2048).T
        assert (logits - want[i]["final_hidden"] @ want.head.T).abs().max() < 1e-9
        assert (seen[i]["aux_hidden"] - want[i]["aux_hidden"]).abs().max() > 1e-2  # as read, it is rotated
    assert (got.target_embedding() - want.embedding).abs().max() < 1e-12
    ids = torch.tensor([3, 7, 11])
    assert torch.allclose(got.target_head_rows_at(ids), got.target_head_rows(0, 2048)[ids])
    assert got.manifest is seen.manifest and len(got) == 2 and got.for_epoch(1) is got


COMMON = ["train", "model=tiny_qwen3", "data.num_samples=16", "trainer.max_steps=4", "trainer.micro_batch_size=2",
          "trainer.save_every=2", "cache.dtype=fp32", "cache.batch_size=1"]
# The rotations of w8a8_int8_quarot with no quantization: a rotated target that computes
# what the unrotated one does, up to float32 rounding.
ROTATED = ["quant=w8a8_int8_quarot", "quant.weight=null", "quant.activation=null"]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_unrotated_on_the_rotated_target_is_training_on_the_unrotated_one(tmp_path):
    run_cli([*COMMON, "quant=bf16", f"run_dir={tmp_path / 'plain'}"], cwd=tmp_path)
    run_cli([*COMMON, *ROTATED, "trainer.unrotate=target", f"run_dir={tmp_path / 'unrot'}"], cwd=tmp_path)
    run_cli([*COMMON, *ROTATED, f"run_dir={tmp_path / 'rotated'}"], cwd=tmp_path)
    plain, unrot, rotated = (_losses(tmp_path / name) for name in ("plain", "unrot", "rotated"))
    # Same steps to float32 rounding; trained in the rotated basis, the draft learns otherwise.
    assert max(abs(a - b) for a, b in zip(plain, unrot)) < 1e-4
    assert max(abs(a - b) for a, b in zip(plain, rotated)) > 1e-2
    # The draft it writes is the plain run's draft, folded for R1: final and step checkpoints.
    r1, _ = rotation_matrix("w8a8_int8_quarot", 64)
    for tag in ("final", "step-0000002"):
        ckpt = tmp_path / "unrot" / "checkpoints" / tag
        meta = json.loads((ckpt / "draft_config.json").read_text())
        assert meta["rotation"] == {"quant": "w8a8_int8_quarot", "kind": "hadamard", "seed": 0, "trained": "unrotated"}
        want = fold_into_eagle3(load_file(str(tmp_path / "plain" / "checkpoints" / tag / "draft.safetensors")),
                                meta, r1)
        got = load_file(str(ckpt / "draft.safetensors"))
        assert got.keys() == want.keys()
        for name in got:
            if not got[name].is_floating_point():  # the vocabulary maps
                assert torch.equal(got[name], want[name]), name
                continue
            assert (got[name] - want[name]).abs().max() <= 1e-3 * max(want[name].abs().max(), 1e-3), name
    # Folded already: fold-rotation refuses it rather than folding twice.
    proc = run_cli(["fold-rotation", str(tmp_path / "unrot"), str(tmp_path / "twice"),
                    "--rotation", "w8a8_int8_quarot"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "already folded" in proc.stderr
    # Each draft carries the basis it reads; one trained on the rotated target is refused
    # too (folding R1 into it was a double rotation, exit 0), also when its draft_config
    # predates the record and only its run config says so.
    bases = {name: json.loads((tmp_path / name / "checkpoints" / "final" / "draft_config.json").read_text())["basis"]
             for name in ("plain", "unrot", "rotated")}
    assert bases == {"plain": "unrotated", "unrot": "rotated", "rotated": "rotated"}
    old = tmp_path / "rotated" / "checkpoints" / "step-0000002" / "draft_config.json"
    old.write_text(json.dumps({k: v for k, v in json.loads(old.read_text()).items() if k != "basis"}))
    for tag in ("final", "step-0000002"):
        proc = run_cli(["fold-rotation", str(tmp_path / "rotated" / "checkpoints" / tag), str(tmp_path / "twice"),
                        "--rotation", "w8a8_int8_quarot"], cwd=tmp_path, check=False)
        assert proc.returncode == 2 and "would rotate it twice" in proc.stderr, proc.stderr
        assert not (tmp_path / "twice").exists()


@pytest.mark.parametrize("overrides, says", [
    (["quant=mxfp4", "trainer.unrotate=target"], "rotates no residual stream"),
    ([*ROTATED, "trainer.unrotate=target", "draft=peagle"], "folds the rotation into EAGLE-3 drafts"),
    ([*ROTATED, "trainer.unrotate=target", "draft.quant=w8a8_int8"], "off their grid"),
    ([*ROTATED, "trainer.unrotate=sideways"], "a .safetensors file with R1"),
])
def test_bad_unrotate_is_one_line_and_trains_nothing(tmp_path, overrides, says):
    proc = run_cli([*COMMON, *overrides, f"run_dir={tmp_path / 'run'}", f"cache.root={tmp_path / 'cache'}"],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "cache").exists()  # refused before stage 1


def test_rotation_comes_from_a_matrix_file(tmp_path):
    from safetensors.torch import save_file

    r1, _ = rotation_matrix("w8a8_int8_quarot", 64)
    save_file({"r1": r1.float()}, str(tmp_path / "r1.safetensors"))
    got, record = served_rotation(root_cfg("model=tiny_qwen3", "quant=w8a8_int8_quarot",
                                           f"trainer.unrotate={tmp_path / 'r1.safetensors'}"))
    assert (got - r1).abs().max() < 1e-6 and record["file"].endswith("r1.safetensors")
    # a target without a rotation has nothing to unrotate, whatever the source of R1 (a
    # file was accepted, and the draft folded out of its target's basis)
    for source in ("target", str(tmp_path / "r1.safetensors")):
        with pytest.raises(ConfigError, match="rotates no residual stream"):
            served_rotation(root_cfg("model=tiny_qwen3", "quant=bf16", f"trainer.unrotate={source}"))


def test_a_rotated_checkpoint_gives_the_matrix_its_quantizer_saved():
    """quant=checkpoint: trainer.unrotate=target reads msModelSlim's saved R1; a checkpoint
    without one is refused."""
    from test_msmodelslim_checkpoints import QUAROT

    from specft.quantized_checkpoints.msmodelslim import saved_rotation

    cfg = root_cfg("model=hf", f"model.path={QUAROT}", "quant=checkpoint", "trainer.unrotate=target")
    r1, record = served_rotation(cfg)
    assert record == {"checkpoint": str(QUAROT)} and torch.equal(r1, saved_rotation(QUAROT).double())
    plain = root_cfg("model=hf", f"model.path={QUAROT.parent / 'w8a8_dynamic'}", "quant=checkpoint",
                     "trainer.unrotate=target")
    with pytest.raises(Exception, match="is not rotated"):
        served_rotation(plain)
