"""The speculative decoding engine: exact greedy output, exact sampling distribution,
oracle and noisy drafts, chain drafting equal to the training unroll."""

import math

import pytest
import torch

from specft.config import aux_layer_ids
from specft.data import load_conversations
from specft.data.template import prompt_ids
from specft.decoding import SamplingConfig, SpecDecoder
from specft.decoding.draft import ChainRunner, TargetAsDraft
from specft.decoding.sampling import warp
from specft.drafts import DraftHeadConfig, Eagle3Draft, MtpDraft
from specft.quant import apply_quant
from specft.target_model import load_target, load_tokenizer

from helpers import context_in_three_extends, root_cfg

pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(model="tiny_qwen3", quant="mxfp4", n=16, dtype=torch.float64):
    cfg = root_cfg(f"model={model}", f"quant={quant}")
    tok = load_tokenizer(cfg.model)
    m, _ = load_target(cfg.model)
    apply_quant(m, cfg.quant)
    m = m.to(dtype).eval()
    prompts = [prompt_ids(tok, c[:1]) for c in load_conversations(cfg.data)[:n]]
    return cfg, tok, m, prompts


def _reference(m, tok, prompts, n):
    """The target's own greedy output, one prompt at a time, by transformers' generate."""
    out = []
    for p in prompts:
        g = m.generate(input_ids=torch.tensor([p]), max_new_tokens=n, do_sample=False,
                       eos_token_id=tok.eos_token_id, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


class NoisyOracle(TargetAsDraft):
    """The target drafting for itself, but each drafted token is replaced by a random
    one with probability ``eps``: its agreement with the target is 1 - eps per token."""

    def __init__(self, model, eps, seed=0):
        super().__init__(model)
        self.eps = eps
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, hidden, logits, k, s, min_confidence=0.0, generator=None):
        prop = super().propose(hidden, logits, k, s, min_confidence, generator)
        flip = torch.rand(prop.tokens.shape, generator=self.gen) < self.eps
        noise = torch.randint(0, logits.shape[-1], prop.tokens.shape, generator=self.gen)
        prop.tokens = torch.where(flip, noise, prop.tokens)
        return prop


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_greedy_speculative_output_is_the_targets_own(model):
    cfg, tok, m, prompts = _setup(model)
    n = 20
    ref = _reference(m, tok, prompts, n)
    eos = {tok.eos_token_id}
    ids = aux_layer_ids(cfg.model)
    alone = SpecDecoder(m, None, ids, eos).generate(prompts, 0, n).tokens
    assert alone == ref
    for k in range(1, 9):
        draft = NoisyOracle(m, eps=0.3, seed=k)  # rows accept different lengths each round
        wide = SpecDecoder(m, draft, ids, eos).generate(prompts, k, n)
        assert wide.tokens == ref, f"k={k} batch 16"
        assert 0 < wide.stats.accepted < wide.stats.proposed
        one = [SpecDecoder(m, NoisyOracle(m, 0.3, k), ids, eos).generate([p], k, n).tokens[0]
               for p in prompts[:2]]
        assert one == ref[:2], f"k={k} batch 1"


def test_oracle_draft_is_always_accepted():
    cfg, tok, m, prompts = _setup(n=8, dtype=torch.float32)
    res = SpecDecoder(m, TargetAsDraft(m), aux_layer_ids(cfg.model), set()).generate(prompts, 4, 30)
    st = res.stats
    assert st.acceptance_rate == 1.0 and st.accepted_at == st.proposed_at
    assert st.acceptance_length == 5.0  # k accepted + the target's own token per forward
    assert all(len(t) == 30 for t in res.tokens)


def test_noisy_draft_is_accepted_at_the_rate_its_agreement_implies():
    cfg, tok, m, prompts = _setup(n=16, dtype=torch.float32)
    eps, k = 0.3, 3
    st = SpecDecoder(m, NoisyOracle(m, eps), aux_layer_ids(cfg.model), set()).generate(prompts, k, 60).stats
    # Position j is accepted when it and every earlier draft agree: (1 - eps) ** (j + 1).
    for j in range(k):
        rate = st.accepted_at[j] / st.proposed_at[j]
        assert abs(rate - (1 - eps) ** (j + 1)) < 0.08, (j, rate)
    expected = sum((1 - eps) ** (j + 1) for j in range(k)) / k
    assert abs(st.acceptance_rate - expected) < 0.06


def test_speculative_sampling_keeps_the_targets_distribution():
    """Joint frequencies of the first two sampled tokens, with a draft unlike the target,
    against the exact distribution computed from the target (chi-square, p = 0.001)."""
    cfg, tok, m, prompts = _setup(n=1, dtype=torch.float64)
    s = SamplingConfig(temperature=1.0, top_k=4)
    prompt = prompts[0]
    with torch.no_grad():
        p1 = warp(m(torch.tensor([prompt])).logits[0, -1], s)
        exact = {}
        for a in p1.nonzero().flatten().tolist():
            p2 = warp(m(torch.tensor([prompt + [a]])).logits[0, -1], s)
            for b in p2.nonzero().flatten().tolist():
                exact[(a, b)] = (p1[a] * p2[b]).item()
    # The draft: the target with its logits shuffled across the vocab (q far from p).
    perm = torch.randperm(m.config.vocab_size, generator=torch.Generator().manual_seed(0))

    class Shuffled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = m
            self.generation_config = m.generation_config

        def forward(self, **kw):
            out = self.inner(**kw)
            out.logits = 0.5 * out.logits + 0.5 * out.logits[..., perm]
            return out

    counts = {}
    ids = aux_layer_ids(cfg.model)
    n_rows = 400
    accepted = 0
    for seed in range(3):
        res = SpecDecoder(m, TargetAsDraft(Shuffled()), ids, set()).generate(
            [prompt] * n_rows, 2, 2, s, seed=seed)
        accepted += res.stats.accepted
        for t in res.tokens:
            counts[tuple(t[:2])] = counts.get(tuple(t[:2]), 0) + 1
    total = sum(counts.values())
    assert set(counts) <= set(exact), "a token outside the target's top-k was emitted"
    chi2 = sum((counts.get(key, 0) - total * p) ** 2 / (total * p) for key, p in exact.items())
    dof = len(exact) - 1
    critical = dof + 3.09 * math.sqrt(2 * dof) + 2  # ~ the 0.999 quantile for these dofs
    assert chi2 < critical, (chi2, critical)
    assert 0 < accepted < total  # both the accept and the residual paths were taken


def test_dynamic_draft_length_stops_unsure_rows_and_stays_exact():
    cfg, tok, m, prompts = _setup(n=6)
    ref = _reference(m, tok, prompts, 16)
    res = SpecDecoder(m, NoisyOracle(m, 0.0), aux_layer_ids(cfg.model), {tok.eos_token_id}).generate(
        prompts, 6, 16, min_confidence=0.5)
    assert res.tokens == ref
    assert res.stats.proposed < 6 * res.stats.rounds  # some rows stopped drafting early


def _small_eagle(mtp=False):
    torch.manual_seed(0)
    c = DraftHeadConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                     target_vocab_size=64, draft_vocab_size=40, num_layers=1 if mtp else 2)
    d2t = torch.sort(torch.randperm(64)[:40]).values
    if mtp:
        d = MtpDraft(c, torch.randn(64, 32), d2t, torch.randn(64, 32)[d2t])
    else:
        d = Eagle3Draft(c, torch.randn(64, 32), d2t)
    for p in d.parameters():
        p.data.normal_(0, 0.3)
    return d.double().eval()


@pytest.mark.parametrize("arch", ["eagle3", "mtp"])
def test_cached_chain_drafting_equals_the_training_unroll(arch):
    """Draft in three extends (one row with a hole), then a k-step chain; the chain's
    logits equal the training forward's step-j logits at the last context position, fed
    the same tokens (exact for every step for EAGLE-3; for step 0 for MTP, whose later
    training steps attend a separate sequence)."""
    draft = _small_eagle(mtp=arch == "mtp")
    runner = ChainRunner(draft)
    x, aux, keep, nxt = context_in_three_extends(hidden=32)
    final = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    runner.reset(2, "cpu")
    chunks = [(0, 4), (4, 8), (8, 11)]
    for a, b in chunks:
        hidden, logits = runner.extend(aux[:, a:b], final[:, a:b], x[:, a:b], nxt[:, a:b], keep[:, a:b])
    seen = []
    real_logits = runner._logits
    runner._logits = lambda h: seen.append(real_logits(h)) or seen[-1]
    k = 4
    prop = runner.propose(hidden, logits, k, SamplingConfig())
    chain = [logits, *seen]
    for row in range(2):
        cols = keep[row].nonzero().flatten()
        seq = torch.cat([x[row, cols], x[row, 11:12], prop.tokens[row, :-1]])[None]
        pad = k
        a = torch.cat([aux[row, cols], torch.zeros(pad, 96, dtype=torch.float64)])[None]
        f = torch.cat([final[row, cols], torch.zeros(pad, 32, dtype=torch.float64)])[None]
        out = draft(seq, a, f, steps=k)
        last = len(cols) - 1
        steps = range(k) if arch == "eagle3" else range(1)
        for j in steps:
            torch.testing.assert_close(chain[j][row], out.logits[j][0, last], rtol=1e-9, atol=1e-9)
