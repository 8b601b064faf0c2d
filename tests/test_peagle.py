"""P-EAGLE (draft=peagle): one draft forward per round drafts what the training unroll
scores, decoding with it is exact, its limits and its serving layout."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_spec import _reference, _setup

from specft.config import aux_layer_ids
from specft.decoding import SamplingConfig, SpecDecoder
from specft.drafts import DraftHeadConfig
from specft.drafts.peagle import PEagleDraft
from specft.drafts.peagle.runner import ParallelRunner

from conftest import run_cli
from helpers import steered


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _small_peagle(target_vocab=64, hidden=32, aux=96, layers=2, k=8, seed=0):
    torch.manual_seed(seed)
    c = DraftHeadConfig(hidden_size=hidden, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                        target_vocab_size=target_vocab, draft_vocab_size=40, num_layers=layers,
                        num_aux_layers=3, target_hidden_size=aux // 3,
                        options={"mask_token_id": target_vocab - 1}, max_draft_tokens=k)
    d2t = torch.sort(torch.randperm(target_vocab)[:40]).values
    d = PEagleDraft(c, torch.randn(target_vocab, hidden), d2t)
    for p in d.parameters():
        p.data.normal_(0, 0.3)
    return d.double().eval()


def _count_forwards(draft):
    calls = []
    layer = draft.layers[0]
    real = layer.step
    layer.step = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    return calls


def test_one_forward_drafts_what_the_training_unroll_scores():
    """Context in three extends (one row with a hole), then k tokens from one forward:
    position j's logits equal the training forward's step-j logits at the last context
    position, and the draft's layers ran once per round, not once per token."""
    draft = _small_peagle(target_vocab=64, hidden=32, aux=96)
    runner = ParallelRunner(draft)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (2, 12), generator=gen)
    aux = torch.randn(2, 12, 96, generator=gen, dtype=torch.float64)
    runner.reset(2, "cpu")
    keep = torch.ones(2, 11, dtype=torch.bool)
    keep[1, 5] = False  # row 1 rejected the token at column 5
    nxt = x.clone()
    for row in range(2):
        cols = [*keep[row].nonzero().flatten().tolist(), 11]
        for here, after in zip(cols, cols[1:]):
            nxt[row, here] = x[row, after]
    k = 5
    seen = []
    real_logits = runner._logits
    runner._logits = lambda h: seen.append(real_logits(h)) or seen[-1]
    for a, b in [(0, 4), (4, 8), (8, 11)]:
        assert runner.extend(aux[:, a:b], None, x[:, a:b], nxt[:, a:b], keep[:, a:b]) == (None, None)
        calls = _count_forwards(draft)
        prop = runner.propose(None, None, k, SamplingConfig())
        assert len(calls) == 1
    drafted = seen[-1]  # [B, k, Vd]: the last round's k positions
    for row in range(2):
        cols = keep[row].nonzero().flatten()
        seq = torch.cat([x[row, cols], x[row, 11:12], prop.tokens[row, :-1]])[None]
        a = torch.cat([aux[row, cols], torch.zeros(k, 96, dtype=torch.float64)])[None]
        out = draft(seq, a, None, steps=k)
        for j in range(k):
            torch.testing.assert_close(drafted[row, j], out.logits[j][0, len(cols) - 1], rtol=1e-9, atol=1e-9)


def test_mask_slots_ignore_the_tokens_before_them():
    """A mask slot's inputs are the same whatever was drafted: the unroll's step j >= 1
    does not change when the true tokens after position p do (only step 0 reads x[p+1])."""
    draft = _small_peagle()
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 64, (1, 10), generator=gen)
    aux = torch.randn(1, 10, 96, generator=gen, dtype=torch.float64)
    y = x.clone()
    y[0, 6:] = (y[0, 6:] + 7) % 64
    a, b = draft(x, aux, None, steps=4), draft(y, aux, None, steps=4)
    # Position 4 reads x[5] at step 0, its mask slots nothing of x[6:]: all steps equal.
    for j in range(4):
        torch.testing.assert_close(a.logits[j][0, 4], b.logits[j][0, 4])
    assert not torch.allclose(a.logits[0][0, 5], b.logits[0][0, 5])  # step 0 at 5 reads x[6]


SteeredParallel = steered(ParallelRunner)


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_greedy_parallel_drafting_is_the_targets_own_output(model):
    """float64, every k from 1 to 8, batch 16 (rows accept different lengths) and batch 1."""
    cfg, tok, m, prompts = _setup(model)
    n = 20
    ref = _reference(m, tok, prompts, n)
    c = cfg.model
    ids = aux_layer_ids(c)
    draft = _small_peagle(target_vocab=c.vocab_size, hidden=c.hidden_size, aux=3 * c.hidden_size)
    eos = {tok.eos_token_id}
    plain = SpecDecoder(m, ParallelRunner(draft), ids, eos).generate(prompts, 3, n)
    assert plain.tokens == ref and plain.stats.proposed == 3 * plain.stats.rounds
    for k in range(1, 9):
        runner = SteeredParallel(draft, m, eps=0.3, seed=k)
        wide = SpecDecoder(m, runner, ids, eos).generate(prompts, k, n)
        assert wide.tokens == ref, f"k={k} batch 16"
        assert 0 < wide.stats.accepted < wide.stats.proposed
        assert all(t.shape[1] == k for t in runner.drafted)  # one forward gave all k
        one = []
        for p in prompts[:2]:
            runner = SteeredParallel(draft, m, 0.3, k)
            one.append(SpecDecoder(m, runner, ids, eos).generate([p], k, n).tokens[0])
        assert one == ref[:2], f"k={k} batch 1"


def test_train_eval_export_from_the_command_line(tmp_path):
    """`specft train draft=peagle` trains on the quantized target's cache; eval decodes
    with one draft forward a round and refuses a k past the trained slots; export writes
    vLLM's EAGLE-3 layout with mask_hidden and mask_token_id."""
    common = ["model=tiny_qwen3", "quant=mxfp4"]
    run_cli(["train", *common, "draft=peagle", "draft.ttt_steps=4", "eval.k=[2,4]", "trainer.max_steps=4",
             "data.num_samples=48"], cwd=tmp_path)
    run = tmp_path / "runs/tiny_qwen3-mxfp4-peagle-kl"
    meta = json.loads((run / "checkpoints/final/draft_config.json").read_text())
    assert (meta["architecture"], meta["max_draft_tokens"], meta["options"]) == ("peagle", 4, {"mask_token_id": 2047})
    run_cli(["eval", *common, f"eval.drafts=[{run}]", "eval.k=[4]", "eval.batch_sizes=[4]", "eval.num_prompts=4",
             "eval.max_new_tokens=12", f"eval.out_dir={run / 'eval'}"], cwd=tmp_path)
    (alone, drafted) = json.loads((run / "eval/results.json").read_text())["results"]
    assert drafted["k"] == 4 and len(drafted["acceptance_at"]) == 4 and drafted["flip_rate"] == 0.0
    before = sorted(p.name for p in run.iterdir())
    bad = run_cli(["eval", *common, f"eval.drafts=[{run}]", "eval.k=[5]"], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        f"error: eval.k: {run} is a peagle draft trained to draft at most 4 tokens a round; "
        "got k=5 (allowed: 1..4)")
    assert sorted(p.name for p in run.iterdir()) == before
    out = tmp_path / "export"
    run_cli(["export", str(run), str(out), "--layout", "peagle", "--dtype", "float32"], cwd=tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["mask_token_id"] == 2047 and config["architectures"] == ["Eagle3Qwen3ForCausalLM"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        mask_hidden = f.get_tensor("mask_hidden")
    state = load_file(str(run / "checkpoints/final/draft.safetensors"))
    assert torch.equal(mask_hidden, state["mask_hidden"]) and mask_hidden.shape == (3 * 64,)
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight"} <= names  # full vocab: no d2t
    wrong = run_cli(["export", str(run), str(tmp_path / "e3"), "--layout", "eagle3"], cwd=tmp_path, check=False)
    assert wrong.returncode == 2 and "use --layout peagle" in wrong.stderr


@pytest.mark.parametrize("args,line", [
    (["draft=peagle", "draft.ttt_steps=3", "eval.k=[3,4,5]"],
     "error: eval.k: a peagle draft drafts at most 3 tokens a round (draft.ttt_steps=3), so validation cannot "
     "replay k=5; raise draft.ttt_steps or lower eval.k"),
    (["draft=peagle", "draft.options.mask_token_id=4096"],
     "error: draft.options.mask_token_id: a token id of the target, 0..2047; got 4096"),
    (["draft=peagle", "+draft.options.mask_tokens=3"],
     "error: draft.options: a peagle draft takes mask_token_id; got ['mask_tokens']"),
    (["+draft.options.mask_token_id=3"], "error: draft.options: draft.name=eagle3 takes no options; got ['mask_token_id']"),
])
def test_bad_parallel_draft_configs_are_one_line(tmp_path, args, line):
    proc = run_cli(["train", "model=tiny_qwen3", "quant=mxfp4", *args], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == line
    assert not any(tmp_path.iterdir())
