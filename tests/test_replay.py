"""Replayed decoding (train/replay.py) against the decoding engine itself."""

import torch
from test_spec import _setup

from specft.config import aux_layer_ids
from specft.decoding import SpecDecoder
from specft.decoding.draft import ChainRunner
from specft.decoding.engine import RoundCounts
from specft.drafts import DraftHeadConfig, Eagle3Draft
from specft.target_model.features import FeatureCapture
from specft.train.losses import MixtureLoss
from specft.train.objective import TargetView, ttt_objective
from specft.train.replay import answer_spans, replay_sample, step_hits


def test_replay_walks_rounds_by_the_leading_hits():
    # One turn of 9 answer tokens (positions 2..10 predict them), k = 3.
    predicts = torch.zeros(14, dtype=torch.bool)
    predicts[2:11] = True
    assert answer_spans(predicts) == [(2, 11)]
    hits = torch.zeros(3, 14, dtype=torch.bool)
    hits[:, 2] = True  # round 1 at p=2: all 3 accepted, emitted 1 + 4 = 5, next p = 6
    hits[0, 6] = True  # round 2 at p=6: 1 accepted (step 1 misses), emitted 7, next p = 8
    hits[1, 8] = True  # round 3 at p=8: step 0 misses, so step 1's hit does not count
    c = replay_sample(hits, predicts, 3, max_new_tokens=100)
    # round 4 at p=9: nothing; emitted 9 = the turn's length: done
    assert (c.rounds, c.proposed, c.accepted) == (4, 12, 4)
    # A budget of 5 new tokens stops after the first round.
    c = replay_sample(hits, predicts, 3, max_new_tokens=5)
    assert (c.rounds, c.accepted) == (1, 3)
    assert RoundCounts(4, 12, 4).acceptance_length == 2.0


def _draft_for(m, seqs, aux, final, predicts, k):
    """An EAGLE-3 draft fitted for a few steps to these sequences (so it hits often)."""
    c = m.config
    torch.manual_seed(0)
    vocab = torch.unique(torch.cat([s for s in seqs]))
    cfg = DraftHeadConfig(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                       num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                       intermediate_size=c.intermediate_size, target_vocab_size=c.vocab_size,
                       draft_vocab_size=len(vocab), qk_norm=True)
    draft = Eagle3Draft(cfg, m.get_input_embeddings().weight.detach(), vocab).double()
    with torch.no_grad():
        logits = m.lm_head(final)
    view = TargetView(torch.softmax(logits[..., vocab], -1), logits.argmax(-1), predicts,
                      draft.t2d[logits.argmax(-1)].double())
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    loss = MixtureLoss({"kl": 1.0})
    for _ in range(80):
        res = ttt_objective(draft(ids, aux, final, k).logits, view, draft.draft_to_target, loss, 0.8)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    draft.eval()
    with torch.no_grad():
        res = ttt_objective(draft(ids, aux, final, k).logits, view, draft.draft_to_target, loss, 0.8)
    return draft, res


def test_replay_on_the_targets_answers_counts_what_decoding_counts():
    """Teacher-forced on the target's own greedy answers, the replay reproduces the
    engine's rounds, proposals and acceptances prompt by prompt (float64: exact)."""
    cfg, tok, m, prompts = _setup(n=6)
    n, k = 24, 3
    ids = aux_layer_ids(cfg.model)
    eos = {tok.eos_token_id}
    answers = SpecDecoder(m, None, ids, eos).generate(prompts, 0, n).tokens
    seqs = [torch.tensor(p + a) for p, a in zip(prompts, answers)]
    batch = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    attn = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
    # One sequence at a time: no padding effects on the features.
    feats = [FeatureCapture(m, ids)(s[None], torch.ones_like(s)[None]) for s in seqs]
    aux = torch.zeros(*batch.shape, feats[0][0].shape[-1], dtype=torch.float64)
    final = torch.zeros(*batch.shape, feats[0][1].shape[-1], dtype=torch.float64)
    predicts = torch.zeros(batch.shape, dtype=torch.float64)
    for row, ((a, f), p) in enumerate(zip(feats, prompts)):
        aux[row, : a.shape[1]], final[row, : f.shape[1]] = a[0], f[0]
        predicts[row, len(p) - 1: len(seqs[row]) - 1] = 1  # position t predicts answer token t+1
    assert attn.sum() == sum(len(s) for s in seqs)
    draft, res = _draft_for(m, seqs, aux, final, predicts, k)
    hits = step_hits(res.step_hits, batch.shape[1])
    replayed = [replay_sample(hits[:, row], predicts[row], k, n) for row in range(len(seqs))]
    decoded = SpecDecoder(m, ChainRunner(draft), ids, eos).generate(prompts, k, n)
    assert decoded.tokens == answers
    assert [[c.rounds, c.proposed, c.accepted] for c in replayed] == decoded.stats.per_prompt
    assert 0 < decoded.stats.accepted < decoded.stats.proposed  # a test that could fail
