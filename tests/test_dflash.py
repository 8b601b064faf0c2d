"""DFlash (draft=dflash): one block forward per round drafts what the training forward
scores, decoding with it is exact, and its serving layout."""

import json

import pytest
import torch
from safetensors import safe_open
from test_spec import _reference, _setup

from specft.config import aux_layer_ids
from specft.decoding import SamplingConfig, SpecDecoder
from specft.drafts import DraftHeadConfig
from specft.drafts.dflash import DFlashDraft
from specft.drafts.dflash.runner import BlockRunner

from conftest import run_cli
from helpers import steered


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _small_dflash(target_vocab=64, hidden=32, aux=96, layers=2, k=8, seed=0):
    torch.manual_seed(seed)
    c = DraftHeadConfig(hidden_size=hidden, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                        target_vocab_size=target_vocab, draft_vocab_size=40, num_layers=layers,
                        num_aux_layers=3, target_hidden_size=aux // 3,
                        options={"mask_token_id": target_vocab - 1}, max_draft_tokens=k)
    d2t = torch.sort(torch.randperm(target_vocab)[:40]).values
    d = DFlashDraft(c, torch.randn(target_vocab, hidden), d2t)
    for p in d.parameters():
        p.data.normal_(0, 0.3)
    return d.double().eval()


def test_one_block_forward_drafts_what_the_training_forward_scores():
    """Context in three extends (one row with a hole), then a block of k: slot j's logits
    equal the training forward's step-j logits at the last context position."""
    draft = _small_dflash()
    runner = BlockRunner(draft)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (2, 12), generator=gen)
    aux = torch.randn(2, 12, 96, generator=gen, dtype=torch.float64)
    runner.reset(2, "cpu")
    keep = torch.ones(2, 11, dtype=torch.bool)
    keep[1, 5] = False
    nxt = x.clone()
    for row in range(2):
        cols = [*keep[row].nonzero().flatten().tolist(), 11]
        for here, after in zip(cols, cols[1:]):
            nxt[row, here] = x[row, after]
    k = 5
    seen = []
    real = draft.logits
    draft.logits = lambda h: seen.append(real(h)) or seen[-1]
    for a, b in [(0, 4), (4, 8), (8, 11)]:
        assert runner.extend(aux[:, a:b], None, x[:, a:b], nxt[:, a:b], keep[:, a:b]) == (None, None)
        runner.propose(None, None, k, SamplingConfig())
    drafted = seen[-1]  # [B, k, Vd]
    for row in range(2):
        cols = keep[row].nonzero().flatten()
        seq = torch.cat([x[row, cols], x[row, 11:12]])[None]
        a = torch.cat([aux[row, cols], torch.zeros(1, 96, dtype=torch.float64)])[None]
        out = draft(seq, a, None, steps=k)
        for j in range(k):
            torch.testing.assert_close(drafted[row, j], out.logits[j][0, len(cols) - 1], rtol=1e-9, atol=1e-9)


def test_a_block_reads_no_token_after_its_first():
    """The training forward's block at position e reads x[e+1] and the features at <= e:
    changing later tokens or features leaves it as it is."""
    draft = _small_dflash()
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 64, (1, 10), generator=gen)
    aux = torch.randn(1, 10, 96, generator=gen, dtype=torch.float64)
    y, aux2 = x.clone(), aux.clone()
    y[0, 6:] = (y[0, 6:] + 7) % 64
    aux2[0, 5:] += 1.0
    a, b = draft(x, aux, None, steps=4), draft(y, aux2, None, steps=4)
    for j in range(4):
        torch.testing.assert_close(a.logits[j][0, 4], b.logits[j][0, 4])
    assert not torch.allclose(a.logits[0][0, 5], b.logits[0][0, 5])


SteeredBlock = steered(BlockRunner)


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_greedy_block_drafting_is_the_targets_own_output(model):
    """float64, every k from 1 to 8, batch 16 (rows accept different lengths) and batch 1."""
    cfg, tok, m, prompts = _setup(model)
    n = 20
    ref = _reference(m, tok, prompts, n)
    c = cfg.model
    ids = aux_layer_ids(c)
    draft = _small_dflash(target_vocab=c.vocab_size, hidden=c.hidden_size, aux=3 * c.hidden_size)
    eos = {tok.eos_token_id}
    plain = SpecDecoder(m, BlockRunner(draft), ids, eos).generate(prompts, 3, n)
    assert plain.tokens == ref and plain.stats.proposed == 3 * plain.stats.rounds
    for k in range(1, 9):
        runner = SteeredBlock(draft, m, eps=0.3, seed=k)
        wide = SpecDecoder(m, runner, ids, eos).generate(prompts, k, n)
        assert wide.tokens == ref, f"k={k} batch 16"
        assert 0 < wide.stats.accepted < wide.stats.proposed
        assert all(t.shape[1] == k for t in runner.drafted)
        one = []
        for p in prompts[:2]:
            runner = SteeredBlock(draft, m, 0.3, k)
            one.append(SpecDecoder(m, runner, ids, eos).generate([p], k, n).tokens[0])
        assert one == ref[:2], f"k={k} batch 1"


def test_train_eval_export_from_the_command_line(tmp_path):
    common = ["model=tiny_qwen3", "quant=mxfp4"]
    run_cli(["train", *common, "draft=dflash", "draft.ttt_steps=4", "eval.k=[2,4]", "trainer.max_steps=4",
             "data.num_samples=48"], cwd=tmp_path)
    run = tmp_path / "runs/tiny_qwen3-mxfp4-dflash-kl"
    meta = json.loads((run / "checkpoints/final/draft_config.json").read_text())
    assert (meta["architecture"], meta["max_draft_tokens"], meta["qk_norm"]) == ("dflash", 4, True)
    run_cli(["eval", *common, f"eval.drafts=[{run}]", "eval.k=[4]", "eval.batch_sizes=[4]", "eval.num_prompts=4",
             "eval.max_new_tokens=12", f"eval.out_dir={run / 'eval'}"], cwd=tmp_path)
    (_, drafted) = json.loads((run / "eval/results.json").read_text())["results"]
    assert drafted["k"] == 4 and len(drafted["acceptance_at"]) == 4 and drafted["flip_rate"] == 0.0
    bad = run_cli(["eval", *common, f"eval.drafts=[{run}]", "eval.k=[6]"], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "is a dflash draft trained to draft at most 4 tokens a round" in bad.stderr
    out = tmp_path / "export"
    run_cli(["export", str(run), str(out), "--layout", "dflash", "--dtype", "float32"], cwd=tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 2047, "target_layer_ids": meta["aux_layer_ids"],
                                       "causal": False}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "layers.0.self_attn.k_norm.weight", "layers.0.mlp.up_proj.weight",
            "norm.weight", "lm_head.weight"} <= names and not any(n.startswith("embed_tokens") for n in names)


def test_a_dflash_draft_reads_the_target_layers_stage_one_caches(tmp_path):
    """Five target layers: stage 1 caches them, fc fuses all five; an EAGLE-3 draft takes
    three, and says so in one line before any work."""
    five = ["model=tiny_qwen3", "quant=mxfp4", "model.aux_layer_ids=[0,1,2,3,4]"]
    run_cli(["train", *five, "draft=dflash", "eval.k=[2]", "trainer.max_steps=2", "data.num_samples=16"],
            cwd=tmp_path)
    from safetensors.torch import load_file

    run = tmp_path / "runs/tiny_qwen3-mxfp4-dflash-kl"
    assert load_file(str(run / "checkpoints/final/draft.safetensors"))["fc.weight"].shape == (64, 5 * 64)
    (cache,) = (tmp_path / "cache").iterdir()
    assert json.loads((cache / "manifest.json").read_text())["aux_layer_ids"] == [0, 1, 2, 3, 4]
    bad = run_cli(["train", *five], cwd=tmp_path / "runs", check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "error: model.aux_layer_ids: draft.name=eagle3 fuses 3 layers, got 5: [0, 1, 2, 3, 4]")
