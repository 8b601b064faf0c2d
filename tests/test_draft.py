"""EAGLE-3 head, draft vocabulary and the TTT objective against hand-computed cases."""

import math

import pytest
import torch

from specft.drafts import DraftHeadConfig, Eagle3Draft, MtpDraft, build_draft_vocab
from specft.train.losses import (
    LossInputs,
    MixtureLoss,
    ce_loss,
    hidden_loss,
    kl_loss,
    lk_loss,
    tv_loss,
)
from specft.train.objective import TargetView, acceptance_length, ttt_objective


def test_draft_vocab_top_tokens_and_offsets():
    counts = torch.tensor([0, 5, 1, 5, 0, 9, 2])
    v = build_draft_vocab(counts, 3)
    assert v.draft_to_target.tolist() == [1, 3, 5]  # ties (1, 3) both kept, sorted by id
    assert v.d2t.tolist() == [1, 2, 3]
    assert v.t2d.tolist() == [False, True, False, True, False, True, False]
    assert math.isclose(v.coverage, 19 / 22)
    seen = build_draft_vocab(counts, 100)  # more slots than distinct tokens: the seen ones
    assert seen.draft_to_target.tolist() == [1, 2, 3, 5, 6] and seen.coverage == 1.0
    full = build_draft_vocab(counts, 100, fill_unseen=True)
    assert full.size == 7 and full.t2d.all()
    fill = build_draft_vocab(torch.tensor([0, 0, 3, 0]), 2, fill_unseen=True)
    assert fill.draft_to_target.tolist() == [0, 2]  # unseen tokens fill in id order
    prior = torch.tensor([0.1, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0])
    ranked = build_draft_vocab(counts, 6, prior=prior)  # 5 seen, then the likeliest unseen (4, not 0)
    assert ranked.draft_to_target.tolist() == [1, 2, 3, 4, 5, 6] and ranked.coverage == 1.0
    assert build_draft_vocab(counts, 3, prior=prior).draft_to_target.tolist() == [1, 3, 5]  # counts first


class _Cache:
    """What target_prior reads of a cache: samples' final hidden states and the head."""

    def __init__(self, hidden, head):
        self.hidden, self.head = hidden, head

    def __len__(self):
        return len(self.hidden)

    def __getitem__(self, i):
        return {"final_hidden": self.hidden[i]}

    def target_head_vocab(self):
        return self.head.shape[0]

    def target_head_rows(self, a, b):
        return self.head[a:b]


def test_target_prior_is_the_mean_next_token_distribution():
    from specft.train.vocab_prior import target_prior

    g = torch.Generator().manual_seed(0)
    hidden = [torch.randn(n, 8, generator=g) for n in (5, 300, 7)]
    head = torch.randn(50, 8, generator=g)
    prior = target_prior(_Cache(hidden, head), max_positions=10_000, vocab_chunk=16)
    expected = torch.softmax(torch.cat(hidden) @ head.T, -1).double().mean(0)
    torch.testing.assert_close(prior, expected, rtol=1e-5, atol=1e-9)
    assert abs(prior.sum().item() - 1) < 1e-6  # float32 softmax terms
    part = target_prior(_Cache(hidden, head), max_positions=100)  # a seeded sample of positions
    assert torch.equal(part, target_prior(_Cache(hidden, head), max_positions=100))
    assert not torch.equal(part, prior)


def _draft(qk_norm=False):
    torch.manual_seed(0)
    c = DraftHeadConfig(hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=32,
                     target_vocab_size=50, draft_vocab_size=20, rope_theta=10000.0, qk_norm=qk_norm)
    return Eagle3Draft(c, torch.randn(50, 16), torch.arange(0, 40, 2))


def _attend(q, k, v):
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return probs @ v


def test_ttt_step_matches_chain_drafting_by_hand():
    """Step 1 at position p must equal what chain drafting computes: the draft token at
    position p+1, fed the step-0 hidden state, attending to step-0 keys 0..p and itself."""
    for qk_norm in (False, True):
        d = _draft(qk_norm)
        layer, attn = d.midlayer, d.midlayer.self_attn
        ids = torch.randint(0, 50, (1, 9))
        aux = torch.randn(1, 9, 48)
        with torch.no_grad():
            logits = d(ids, aux, None, steps=2).logits
            g = d.fc(aux)
            x0 = torch.cat([layer.input_layernorm(d.embed_tokens(ids[:, 1:])),
                            layer.hidden_norm(g[:, :8])], -1)
            q0, k0, v0 = attn.qkv(x0, torch.arange(8))
            p = 5
            h0 = g[:, : p + 1] + attn.o_proj(_attend(q0[:, :, : p + 1], k0[:, :, : p + 1], v0[:, :, : p + 1])
                                             .transpose(1, 2).reshape(1, p + 1, -1))
            h0 = h0 + layer.mlp(layer.post_attention_layernorm(h0))
            x1 = torch.cat([layer.input_layernorm(d.embed_tokens(ids[:, p + 2: p + 3])),
                            layer.hidden_norm(h0[:, p: p + 1])], -1)
            q1, k1, v1 = attn.qkv(x1, torch.tensor([p + 1]))
            keys = torch.cat([k0[:, :, : p + 1], k1], 2)
            vals = torch.cat([v0[:, :, : p + 1], v1], 2)
            h1 = h0[:, p: p + 1] + attn.o_proj(_attend(q1, keys, vals).transpose(1, 2).reshape(1, 1, -1))
            h1 = h1 + layer.mlp(layer.post_attention_layernorm(h1))
            torch.testing.assert_close(logits[0][0, p], d.lm_head(d.norm(h0[0, p])))
            torch.testing.assert_close(logits[1][0, p], d.lm_head(d.norm(h1[0, 0])))


def test_losses_hand_cases():
    p = torch.tensor([[0.5, 0.5, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.5]])
    x = LossInputs(torch.log(q), p)
    assert math.isclose(kl_loss(x).item(), math.log(4), rel_tol=1e-6)  # -0.5 ln .25 * 2
    assert math.isclose(lk_loss(x).item(), -math.log(0.5), rel_tol=1e-6)  # min-sum = 0.5
    assert math.isclose(tv_loss(x).item(), 0.5, rel_tol=1e-6)  # 0.5 * (.25 + .25 + .5)
    assert math.isclose(ce_loss(x).item(), -math.log(0.25), rel_tol=1e-6)  # argmax p = 0
    h = LossInputs(x.draft_logits, p, torch.tensor([[0.0, 3.0]]), torch.tensor([[0.5, 0.0]]))
    assert math.isclose(hidden_loss(h).item(), (0.5 * 0.25 + 2.5) / 2, rel_tol=1e-6)  # smooth-L1
    mix = MixtureLoss({"kl": 1.0, "tv": 2.0})
    assert math.isclose(mix(x).item(), math.log(4) + 1.0, rel_tol=1e-6)
    assert acceptance_length([0.5, 0.5]) == 1.75


def test_ttt_objective_shifts_and_masks_per_step():
    # Sequence of 4 positions; target argmax at positions 0..3 = [7, 1, 2, 3].
    vd = 3
    draft_to_target = torch.tensor([1, 2, 3])
    probs = torch.eye(vd)[[0, 0, 1, 2]][None]  # target at pos 1,2,3 -> draft ids 0,1,2
    view = TargetView(probs=probs, argmax=torch.tensor([[7, 1, 2, 3]]),
                      predicts_assistant=torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
                      in_draft_vocab=torch.tensor([[0.0, 1.0, 1.0, 1.0]]))
    perfect = torch.full((1, 4, vd), -30.0)
    perfect[0, 0, 0] = perfect[0, 1, 1] = 30.0  # step 0 at p predicts target at p+1
    step1 = torch.full((1, 4, vd), -30.0)
    step1[0, 0, 0] = 30.0  # wrong: step 1 at p=0 should match target at 2 (draft id 1)
    res = ttt_objective([perfect, step1], view, draft_to_target, kl_loss, 0.8)
    # Step 0 scores positions 0,1 (valid at targets 1,2); position 2's target (3) is not an
    # assistant prediction.
    assert res.step_tokens == [2, 1] and res.step_acc == [1.0, 0.0]
    assert res.step_losses[0] < 1e-6 and math.isclose(res.step_losses[1], 60.0, rel_tol=1e-4)
    assert math.isclose(res.loss.item(), res.step_losses[0] + 0.8 * res.step_losses[1], rel_tol=1e-6)


def test_on_policy_counts_a_step_only_where_the_earlier_proposals_were_verified():
    # 6 positions, all predicting assistant tokens; the target's argmax at p is p (all in
    # the draft vocab, draft id = target id). Step 0 proposes right from p = 0, 1, 3 and
    # wrong from p = 2; step 1's proposals are all wrong (uniform logits: loss ln 6 each).
    v = 6
    view = TargetView(probs=torch.eye(v)[None], argmax=torch.arange(v)[None],
                      predicts_assistant=torch.ones(1, v), in_draft_vocab=torch.ones(1, v))
    step0 = torch.full((1, v, v), -30.0)
    for p, proposal in ((0, 1), (1, 2), (2, 0), (3, 4), (4, 5)):
        step0[0, p, proposal] = 30.0
    step1 = torch.zeros((1, v, v))  # uniform
    ids = torch.arange(v)
    plain = ttt_objective([step0, step1], view, ids, kl_loss, 1.0)
    on = ttt_objective([step0, step1], view, ids, kl_loss, 1.0, on_policy=True)
    # Step 0: every position counts either way (positions 0..4 score targets 1..5).
    assert on.step_losses[0] == plain.step_losses[0] == pytest.approx(60.0 / 5, rel=1e-4)
    # Step 1 scores positions 0..3: all four plainly; on-policy only 0, 1, 3 (step 0 was
    # verified there), still averaged over the four.
    assert plain.step_losses[1] == pytest.approx(math.log(6), rel=1e-5)
    assert on.step_losses[1] == pytest.approx(3 * math.log(6) / 4, rel=1e-5)
    assert on.step_acc == plain.step_acc  # what is measured does not change


def test_mtp_step_is_a_causal_block_over_the_shifted_sequence_by_hand():
    torch.manual_seed(0)
    c = DraftHeadConfig(hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=32,
                     target_vocab_size=50, draft_vocab_size=20, qk_norm=True)
    lm_head = torch.randn(50, 16)
    vocab = torch.arange(0, 40, 2)
    d = MtpDraft(c, torch.randn(50, 16), vocab, lm_head[vocab])
    ids, final = torch.randint(0, 50, (1, 9)), torch.randn(1, 9, 16)
    with torch.no_grad():
        out = d(ids, None, final, steps=2)
        p = 4
        x0 = d.eh_proj(torch.cat([d.hnorm(final[:, : p + 1]), d.enorm(d.embed_tokens(ids[:, 1: p + 2]))], -1))
        h0 = d.block(x0, torch.arange(p + 1))  # causal: a prefix gives the same rows
        torch.testing.assert_close(out.hidden[0][:, : p + 1], h0)
        x1 = d.eh_proj(torch.cat([d.hnorm(out.hidden[0][:, : p + 1]), d.enorm(d.embed_tokens(ids[:, 2: p + 3]))], -1))
        h1 = d.block(x1, torch.arange(1, p + 2))
        torch.testing.assert_close(out.hidden[1][0, p], h1[0, p])
        # The shared head is the target's own lm_head restricted to the draft vocab.
        torch.testing.assert_close(out.logits[1][0, p], d.shared_head["norm"](h1[0, p]) @ lm_head[vocab].T)


def test_extra_eagle3_layers_chain_and_keep_their_own_ttt_keys():
    torch.manual_seed(0)
    c = DraftHeadConfig(hidden_size=16, num_heads=4, num_kv_heads=4, head_dim=4, intermediate_size=32,
                     target_vocab_size=50, draft_vocab_size=20, num_layers=3)
    d = Eagle3Draft(c, torch.randn(50, 16), torch.arange(0, 40, 2))
    assert len(d.extra_layers) == 2 and d.extra_layers[0].self_attn.q_proj.in_features == 16
    ids, aux = torch.randint(0, 50, (1, 6)), torch.randn(1, 6, 48)
    with torch.no_grad():
        out = d(ids, aux, None, steps=1)
        h = d.fc(aux)
        for layer in [d.midlayer, *d.extra_layers]:
            h = layer(d.embed_tokens(torch.nn.functional.pad(ids[:, 1:], (0, 1))), h, torch.arange(6), [], [])
        torch.testing.assert_close(out.hidden[0], h)


def test_target_view_in_vocab_chunks_equals_the_whole_head():
    """A Qwen-sized vocabulary is scored a chunk of head rows at a time; the view must be
    the one the whole [B, T, V] logits give (head kept in bf16, chunks computed in fp32)."""
    from specft.train.objective import target_view
    from specft.train.target_head import TargetHead

    g = torch.Generator().manual_seed(0)
    head = torch.randn(1000, 16, generator=g).bfloat16()
    batch = {"final_hidden": torch.randn(2, 7, 16, generator=g) * 3,
             "loss_mask": torch.ones(2, 7, dtype=torch.long)}
    d2t = torch.tensor([5, 17, 400, 999, 3])
    t2d = torch.zeros(1000, dtype=torch.bool)
    t2d[d2t] = True
    logits = batch["final_hidden"] @ head.float().T
    for chunk in (1000, 128, 333):
        view = target_view(batch, TargetHead(head, 0, 1000, head[d2t]), t2d, vocab_chunk=chunk)
        assert torch.equal(view.argmax, logits.argmax(-1)), chunk
        expected = torch.exp(logits[..., d2t] - torch.logsumexp(logits, -1, keepdim=True))
        torch.testing.assert_close(view.probs_full, expected, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(view.probs, torch.softmax(logits[..., d2t], -1), rtol=1e-5, atol=1e-7)


def test_eval_draft_reads_the_target_embedding_as_served():
    from specft.eval.drafts import share_target_embedding
    from specft.eval.runner import _bytes

    c = DraftHeadConfig(hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=32,
                     target_vocab_size=50, draft_vocab_size=20)
    emb = torch.randn(50, 16)

    class Target(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.embed = torch.nn.Embedding.from_pretrained(weight.clone())

        def get_input_embeddings(self):
            return self.embed

    draft = Eagle3Draft(c, emb, torch.arange(20))
    alone = _bytes(draft)
    target = Target(emb)
    assert share_target_embedding(draft, target) and draft.embed_tokens is target.embed
    assert _bytes(draft, shared_with=target) == alone - emb.numel() * 4
    # A target whose embedding moved (rotated): served drafts read the target's, so does eval.
    other = Target(emb + 1e-3)
    assert share_target_embedding(draft, other) and draft.embed_tokens is other.embed
    wide = Target(torch.randn(50, 32))  # a draft of another width learned its own
    assert not share_target_embedding(draft, wide) and draft.embed_tokens is not wide.embed


def test_draft_layer_starts_from_a_target_layer():
    """draft.init=target_layer: every shared tensor copied; the 2H-wide q/k/v read the
    hidden half with the target's weights and the embedding half with zeros, so the
    projections of [e; h] are the target's projections of h."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from specft.drafts import DRAFT_ARCHS

    hc = Qwen3Config(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, rms_norm_eps=1e-6)
    target = Qwen3DecoderLayer(hc, 0)
    for p in target.parameters():
        torch.nn.init.normal_(p)
    draft = _draft(qk_norm=True)
    copied = DRAFT_ARCHS.get("eagle3").init_from_layer(draft, target)
    assert len(copied) == 11 and "input_layernorm.weight" not in copied  # the embedding's norm stays
    layer = draft.midlayer
    assert torch.equal(layer.hidden_norm.weight, target.input_layernorm.weight)
    assert torch.equal(layer.mlp.down_proj.weight, target.mlp.down_proj.weight)
    assert torch.equal(layer.self_attn.q_norm.weight, target.self_attn.q_norm.weight)
    e, h = torch.randn(3, 16), torch.randn(3, 16)
    for name in ("q_proj", "k_proj", "v_proj"):
        mine, theirs = getattr(layer.self_attn, name), getattr(target.self_attn, name)
        torch.testing.assert_close(mine(torch.cat([e, h], -1)), theirs(h))
