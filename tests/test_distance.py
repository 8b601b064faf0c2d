"""`specft distance`: the served target against its 16-bit model, teacher-forced on held-out
conversations. The agreement is checked against the two models' own forward passes (their
logits' argmax, not the feature capture distance uses), and on pairs whose answer is known:
a model against itself, and the HF FP8 fixture against the compressed-tensors checkpoint it
was renamed from (the same served model in two layouts)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from specft.commands.distance import verdict
from specft.target_model import load_target
from specft.target_model.loader import _tiny_source

from conftest import run_cli
from helpers import root_cfg

CHECKPOINTS = Path(__file__).resolve().parent / "fixtures" / "checkpoints"
GPTQ = CHECKPOINTS / "tiny_qwen3_gptq_awq" / "gptq_autoround"
ARGS = ["data=synthetic", "distance.sequences=6", "model.dtype=float32"]


def _tiny_dir() -> Path:
    return Path(_tiny_source(root_cfg("model=tiny_qwen3").model)[0])


def _distance(tmp_path, model_path: Path, quant: str, reference: Path, *extra: str) -> dict:
    out = tmp_path / "out"
    tmp_path.mkdir(exist_ok=True)
    proc = run_cli(["distance", "model=hf", f"model.path={model_path}", f"quant={quant}",
                    f"distance.reference={reference}", f"distance.out={out}", *ARGS, *extra], cwd=tmp_path)
    result = json.loads((out / "distance.json").read_text())
    assert proc.stdout.strip().splitlines()[-1] == result["verdict"]
    return result


def test_a_checkpoint_against_its_16bit_model_agrees_with_their_own_forwards(tmp_path):
    from specft.data import load_conversations
    from specft.data.template import tokenize_conversation

    reference = _tiny_dir()
    result = _distance(tmp_path, GPTQ, "checkpoint", reference)
    served, tokenizer = load_target(root_cfg("model=hf", f"model.path={GPTQ}", "quant=checkpoint",
                                             "model.dtype=float32").model)
    plain, _ = load_target(root_cfg("model=hf", f"model.path={reference}", "model.dtype=float32").model)
    data = root_cfg(*ARGS).data
    convs = load_conversations(dataclasses.replace(data, split="validation", num_samples=6))
    agree = tokens = 0
    for conv in convs:
        ids = tokenize_conversation(tokenizer, conv, data.max_seq_len)[0].input_ids[None]
        with torch.no_grad():
            a, b = served(ids).logits.argmax(-1), plain(ids).logits.argmax(-1)
        agree, tokens = agree + int((a == b).sum()), tokens + ids.numel()
    assert result["tokens"] == tokens and result["top1_agreement"] == pytest.approx(agree / tokens)
    assert [s["agree"] for s in result["per_sequence"]] and sum(s["agree"] for s in result["per_sequence"]) == agree
    lo, hi = result["top1_agreement_ci95"]
    assert lo <= result["top1_agreement"] <= hi
    assert result["aux_rel_err"] > 0.01 and result["verdict"].startswith("retrain:")


def test_a_model_against_itself_is_at_no_distance(tmp_path):
    reference = _tiny_dir()
    result = _distance(tmp_path, reference, "bf16", reference)
    assert result["top1_agreement"] == 1.0 and result["aux_rel_err"] == 0.0 and result["final_rel_err"] == 0.0
    assert result["verdict"].startswith("keep the 16-bit draft")


def test_fp8_blocks_sit_closer_to_the_16bit_model_than_int4_groups(tmp_path):
    reference = _tiny_dir()
    fp8 = _distance(tmp_path / "fp8", CHECKPOINTS / "tiny_qwen3_hf_fp8", "checkpoint", reference)
    int4 = _distance(tmp_path / "int4", GPTQ, "checkpoint", reference)
    assert fp8["tokens"] == int4["tokens"]
    assert fp8["final_rel_err"] < int4["final_rel_err"] and fp8["top1_agreement"] > int4["top1_agreement"]


@pytest.mark.parametrize("agreement, start", [(0.885, "retrain:"), (0.92, "measure:"), (0.949, "keep the 16-bit")])
def test_the_verdict_reads_the_studied_points(agreement, start):
    assert verdict(agreement).startswith(start)


def test_without_a_reference_it_is_one_line_and_writes_nothing(tmp_path):
    proc = run_cli(["distance", "model=hf", f"model.path={GPTQ}", "quant=checkpoint", *ARGS], cwd=tmp_path,
                   check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: distance.reference: give the 16-bit model's checkpoint directory (the model the quantized one was "
        "made from)"]
    assert list(tmp_path.iterdir()) == []



def test_an_empty_held_out_side_is_distances_own_line_with_the_counts(tmp_path):
    """Two sequences of synthetic data: none falls on the validation side. The line says so
    (what was read, what the split left out) and what to raise (#63)."""
    proc = run_cli(["distance", "model=hf", f"model.path={_tiny_dir()}", "quant=mxfp4",
                    f"distance.reference={_tiny_dir()}", "data=synthetic", "distance.sequences=2"],
                   cwd=tmp_path, check=False)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith("error: distance: data synthetic has no held-out conversation (its validation side "
                                "is empty: data: ")
    assert "on the other side of the train/validation split" in errors[0]
    assert errors[0].endswith("raise distance.sequences or data.val_fraction")
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []

def test_an_existing_drafts_acceptance_against_both_targets_is_what_eval_counts(tmp_path):
    """The 16-bit recipe's draft (trained on tiny Qwen3) against the GPTQ checkpoint made from
    it and against tiny Qwen3 itself: the same counts `specft eval` gives on each target."""
    run_cli(["train", "model=tiny_qwen3", "quant=bf16", "data.num_samples=8", "trainer.max_steps=2",
             "hydra.run.dir=runs/base"], cwd=tmp_path)
    draft = tmp_path / "runs" / "base"
    prompts = ["eval.num_prompts=3", "eval.max_new_tokens=6", "eval.batch_sizes=[2]"]
    result = _distance(tmp_path, GPTQ, "checkpoint", _tiny_dir(), f"distance.draft={draft}", "distance.k=2",
                       *prompts)
    d = result["draft"]
    assert d["k"] == 2 and d["prompts"] == 3
    for side, target in (("on_served", ["model=hf", f"model.path={GPTQ}", "quant=checkpoint"]),
                         ("on_reference", ["model=tiny_qwen3", "quant=bf16"])):
        out = tmp_path / f"eval-{side}"
        run_cli(["eval", *target, f"eval.drafts=[{draft}]", "eval.k=[2]", "eval.target_alone=false",
                 "model.dtype=float32", "data=synthetic", *prompts, f"eval.out_dir={out}"], cwd=tmp_path)
        (row,) = json.loads((out / "results.json").read_text())["results"]
        assert (d[side]["accepted"], d[side]["proposed"]) == (row["accepted"], row["proposed"]), side
        assert d[side]["per_prompt"] == row["per_prompt"]
    diff = d["served_minus_reference"]
    assert diff["rate_difference"] == pytest.approx(d["on_served"]["acceptance_rate"] -
                                                    d["on_reference"]["acceptance_rate"])
