"""Parallel drafters: P-EAGLE (draft=peagle) and DFlash (draft=dflash) draft a round's k
tokens in one forward. That forward drafts what the training forward scores; decoding
with it is exact; train, eval and export run from the command line; bad input is one
line."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_spec import _reference, _setup

from specft.config import aux_layer_ids
from specft.decoding import SamplingConfig, SpecDecoder
from specft.drafts import DraftHeadConfig
from specft.drafts.dflash import DFlashDraft
from specft.drafts.dflash.runner import BlockRunner
from specft.drafts.peagle import PEagleDraft
from specft.drafts.peagle.runner import ParallelRunner

from conftest import run_cli
from helpers import context_in_three_extends, steered

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = {"peagle": (PEagleDraft, ParallelRunner), "dflash": (DFlashDraft, BlockRunner)}


def _small(arch, target_vocab=64, hidden=32, layers=2, k=8):
    torch.manual_seed(0)
    c = DraftHeadConfig(hidden_size=hidden, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                        target_vocab_size=target_vocab, draft_vocab_size=40, num_layers=layers,
                        target_hidden_size=hidden, options={"mask_token_id": target_vocab - 1}, max_draft_tokens=k)
    d2t = torch.sort(torch.randperm(target_vocab)[:40]).values
    draft = ARCHS[arch][0](c, torch.randn(target_vocab, hidden), d2t)
    for p in draft.parameters():
        p.data.normal_(0, 0.3)
    return draft.double().eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_one_forward_drafts_what_the_training_forward_scores(arch):
    """Context in three extends (one row with a hole), each followed by a proposal of k:
    position j's logits equal the training forward's step-j logits at the last context
    position, and the draft's first layer ran once per round, not once per token."""
    draft = _small(arch)
    runner = ARCHS[arch][1](draft)
    x, aux, keep, nxt = context_in_three_extends(hidden=32)
    runner.reset(2, "cpu")
    k = 5
    seen = []
    real_logits = draft.logits
    draft.logits = lambda h: seen.append(real_logits(h)) or seen[-1]
    first = draft.layers[0]
    calls = []
    real_step = first.step
    first.step = lambda *a, **kw: calls.append(1) or real_step(*a, **kw)
    for a, b in [(0, 4), (4, 8), (8, 11)]:
        assert runner.extend(aux[:, a:b], None, x[:, a:b], nxt[:, a:b], keep[:, a:b]) == (None, None)
        calls.clear()
        prop = runner.propose(None, None, k, SamplingConfig())
        assert len(calls) == 1 and prop.tokens.shape == (2, k)
    drafted = seen[-1]  # [B, k, Vd]: the last round's k positions
    for row in range(2):
        cols = keep[row].nonzero().flatten()
        seq = torch.cat([x[row, cols], x[row, 11:12], prop.tokens[row, :-1]])[None]
        a = torch.cat([aux[row, cols], torch.zeros(k, 96, dtype=torch.float64)])[None]
        out = draft(seq, a, None, steps=k)
        for j in range(k):
            torch.testing.assert_close(drafted[row, j], out.logits[j][0, len(cols) - 1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_round_reads_no_token_after_the_first_it_drafts_from(arch):
    """The training forward at position p reads x[p+1] and the features at <= p, nothing
    of the tokens after: a parallel drafter's later slots read mask tokens. Changing
    x[p+2:] (and, for DFlash, the features after p) leaves every step at p as it is."""
    draft = _small(arch)
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 64, (1, 10), generator=gen)
    aux = torch.randn(1, 10, 96, generator=gen, dtype=torch.float64)
    y, later = x.clone(), aux.clone()
    y[0, 6:] = (y[0, 6:] + 7) % 64
    if arch == "dflash":  # its context is the features alone: later ones are never read
        later[0, 5:] += 1.0
    a, b = draft(x, aux, None, steps=4), draft(y, later, None, steps=4)
    for j in range(4):
        torch.testing.assert_close(a.logits[j][0, 4], b.logits[j][0, 4])
    assert not torch.allclose(a.logits[0][0, 5], b.logits[0][0, 5])  # step 0 at 5 reads x[6]


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen3_moe"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parallel_drafting_is_the_targets_own_output(arch, model):
    """float64, every k from 1 to 8, batch 16 (rows accept different lengths) and batch 1."""
    cfg, tok, m, prompts = _setup(model)
    n = 20
    ref = _reference(m, tok, prompts, n)
    c = cfg.model
    ids = aux_layer_ids(c)
    draft = _small(arch, target_vocab=c.vocab_size, hidden=c.hidden_size)
    runner_cls = ARCHS[arch][1]
    eos = {tok.eos_token_id}
    plain = SpecDecoder(m, runner_cls(draft), ids, eos).generate(prompts, 3, n)
    assert plain.tokens == ref and plain.stats.proposed == 3 * plain.stats.rounds
    steered_cls = steered(runner_cls)
    for k in range(1, 9):
        runner = steered_cls(draft, m, eps=0.3, seed=k)
        wide = SpecDecoder(m, runner, ids, eos).generate(prompts, k, n)
        assert wide.tokens == ref, f"k={k} batch 16"
        assert 0 < wide.stats.accepted < wide.stats.proposed
        assert all(t.shape[1] == k for t in runner.drafted)  # one forward gave all k
        one = [SpecDecoder(m, steered_cls(draft, m, 0.3, k), ids, eos).generate([p], k, n).tokens[0]
               for p in prompts[:2]]
        assert one == ref[:2], f"k={k} batch 1"


def _exported(out):
    config = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return config, {name: f.get_tensor(name) for name in f.keys()}


def _check_peagle_export(config, tensors, state):
    """vLLM's EAGLE-3 layout with mask_hidden and mask_token_id."""
    assert config["mask_token_id"] == 2047 and config["architectures"] == ["Eagle3Qwen3ForCausalLM"]
    assert torch.equal(tensors["mask_hidden"], state["mask_hidden"]) and tensors["mask_hidden"].shape == (3 * 64,)
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight"} <= set(tensors)  # full vocab: no d2t


def _check_dflash_export(config, tensors, state):
    """vLLM's DFlash layout: a Qwen3 block, dflash_config, no embedding (vLLM shares the target's)."""
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"]["mask_token_id"] == 2047 and config["dflash_config"]["causal"] is False
    assert {"fc.weight", "hidden_norm.weight", "layers.0.self_attn.k_norm.weight", "layers.0.mlp.up_proj.weight",
            "norm.weight", "lm_head.weight"} <= set(tensors)
    assert not any(n.startswith("embed_tokens") for n in tensors)
    assert torch.equal(tensors["layers.0.self_attn.k_norm.weight"], state["layers.0.self_attn.k_norm.weight"])


@pytest.mark.parametrize("arch,check_export", [("peagle", _check_peagle_export), ("dflash", _check_dflash_export)])
def test_train_eval_export_from_the_command_line(tmp_path, arch, check_export):
    """`specft train draft=ARCH` trains on the quantized target's cache; eval decodes with
    one draft forward a round and refuses a k past the trained slots, changing nothing;
    export writes the layout vLLM loads."""
    common = ["model=tiny_qwen3", "quant=mxfp4"]
    run_cli(["train", *common, f"draft={arch}", "draft.ttt_steps=4", "eval.k=[2,4]", "trainer.max_steps=4",
             "data.num_samples=48"], cwd=tmp_path)
    run = tmp_path / f"runs/tiny_qwen3-mxfp4-{arch}-kl"
    meta = json.loads((run / "checkpoints/final/draft_config.json").read_text())
    assert (meta["architecture"], meta["max_draft_tokens"], meta["options"]) == (arch, 4, {"mask_token_id": 2047})
    run_cli(["eval", *common, f"eval.drafts=[{run}]", "eval.k=[4]", "eval.batch_sizes=[4]", "eval.num_prompts=4",
             "eval.max_new_tokens=12", f"eval.out_dir={run / 'eval'}"], cwd=tmp_path)
    (_, drafted) = json.loads((run / "eval/results.json").read_text())["results"]
    assert drafted["k"] == 4 and len(drafted["acceptance_at"]) == 4 and drafted["flip_rate"] == 0.0
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))  # folders too: no bare runs/<run>/
    bad = run_cli(["eval", *common, f"eval.drafts=[{run}]", "eval.k=[5]"], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        f"error: eval.k: {run} is a {arch} draft trained to draft at most 4 tokens a round; got k=5 (allowed: 1..4)")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    out = tmp_path / "export"
    run_cli(["export", str(run), str(out), "--layout", arch, "--dtype", "float32"], cwd=tmp_path)
    check_export(*_exported(out), load_file(str(run / "checkpoints/final/draft.safetensors")))
    wrong = run_cli(["export", str(run), str(tmp_path / "e3"), "--layout", "eagle3"], cwd=tmp_path, check=False)
    assert wrong.returncode == 2 and f"use --layout {arch}" in wrong.stderr


def test_a_dflash_draft_reads_the_target_layers_stage_one_caches(tmp_path):
    """Five target layers: stage 1 caches them, fc fuses all five; an EAGLE-3 draft takes
    three, and says so in one line before any work."""
    five = ["model=tiny_qwen3", "quant=mxfp4", "model.aux_layer_ids=[0,1,2,3,4]"]
    run_cli(["train", *five, "draft=dflash", "eval.k=[2]", "trainer.max_steps=2", "data.num_samples=16"],
            cwd=tmp_path)
    run = tmp_path / "runs/tiny_qwen3-mxfp4-dflash-kl"
    assert load_file(str(run / "checkpoints/final/draft.safetensors"))["fc.weight"].shape == (64, 5 * 64)
    (cache,) = (tmp_path / "cache").iterdir()
    assert json.loads((cache / "manifest.json").read_text())["aux_layer_ids"] == [0, 1, 2, 3, 4]
    (tmp_path / "other").mkdir()
    bad = run_cli(["train", *five], cwd=tmp_path / "other", check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "error: model.aux_layer_ids: draft.name=eagle3 fuses 3 layers, got 5: [0, 1, 2, 3, 4]")
    assert not any((tmp_path / "other").iterdir())


@pytest.mark.parametrize("args,line", [
    (["draft=peagle", "draft.ttt_steps=3", "eval.k=[3,4,5]"],
     "error: eval.k: a peagle draft drafts at most 3 tokens a round (draft.ttt_steps=3), so validation cannot "
     "replay k=5; raise draft.ttt_steps or lower eval.k"),
    (["draft=dflash", "draft.options.mask_token_id=4096"],
     "error: draft.options.mask_token_id: a token id of the target, 0..2047; got 4096"),
    (["draft=peagle", "+draft.options.mask_tokens=3"],
     "error: draft.options: a peagle draft takes mask_token_id; got ['mask_tokens']"),
    (["+draft.options.mask_token_id=3"],
     "error: draft.options: draft.name=eagle3 takes no options; got ['mask_token_id']"),
])
def test_bad_parallel_draft_configs_are_one_line(tmp_path, args, line):
    proc = run_cli(["train", "model=tiny_qwen3", "quant=mxfp4", *args], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == line
    assert not any(tmp_path.iterdir())


def test_gain_table_pairs_each_drafter_with_its_16bit_twin(monkeypatch):
    """scripts/studies/parallel_drafters.py's gain rows: a drafter trained on the quantized target
    that accepts more on every prompt is 'higher'; one equal to its twin is 'no difference'."""
    import sys
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts" / "studies"))
    sys.modules.pop("parallel_drafters", None)
    from parallel_drafters import gain_table

    def row(draft, accepted):
        per_prompt = [[10, 30, a] for a in accepted]
        return {"data": "gsm8k", "batch_size": 16, "draft": draft, "k": 3, "per_prompt": per_prompt}

    low, high = [3, 5, 4, 6, 2, 5], [9, 11, 8, 12, 7, 10]
    rows = [row("peagle_16bit", low), row("specft_peagle", high), row("dflash_16bit", low), row("specft_dflash", low)]
    lines = gain_table(rows).splitlines()[2:]
    assert len(lines) == 2  # the chain pair has no rows: left out, not guessed
    peagle, dflash = lines
    # (57 - 25) accepted more of 180 proposed
    assert "specft_peagle - peagle_16bit" in peagle and "+17.8 pts" in peagle and "specft_peagle higher" in peagle
    assert "specft_dflash - dflash_16bit" in dflash and "+0.0 pts" in dflash and "no difference" in dflash
