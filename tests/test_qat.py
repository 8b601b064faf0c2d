"""Draft QAT: the draft's linear layers compute exactly as the quant library says."""

import torch
import torch.nn.functional as F

from specft.drafts import DraftHeadConfig, Eagle3Draft
from specft.drafts.qat import apply_draft_qat
from specft.quant import fake_quant

from helpers import quant_cfg


def _draft():
    torch.manual_seed(0)
    c = DraftHeadConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                     target_vocab_size=100, draft_vocab_size=32)
    return Eagle3Draft(c, torch.randn(100, 64), torch.arange(32) * 3)


def test_qat_linear_matches_fake_quant_of_weights_and_inputs():
    draft = _draft()
    q = quant_cfg("mxfp4")
    switched = apply_draft_qat(draft, q)
    assert "lm_head" not in switched and "fc" in switched and "midlayer.mlp.down_proj" in switched
    fc = draft.fc
    x = torch.randn(3, 5, 192)
    expected = F.linear(fake_quant(x, q.activation), fake_quant(fc.weight, q.weight))
    assert torch.equal(fc(x), expected)
    assert torch.equal(draft.lm_head(x[..., :64]), F.linear(x[..., :64], draft.lm_head.weight))


def test_qat_gradients_reach_the_master_weights():
    draft = _draft()
    apply_draft_qat(draft, quant_cfg("fp8"))
    out = draft(torch.randint(0, 100, (2, 7)), torch.randn(2, 7, 192), None, steps=2)
    sum(lg.float().pow(2).mean() for lg in out.logits).backward()
    for name in ("fc", "midlayer.self_attn.q_proj", "midlayer.mlp.gate_proj"):
        grad = dict(draft.named_modules())[name].weight.grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_state_dict_names_are_unchanged_by_qat():
    a, b = _draft(), _draft()
    apply_draft_qat(b, quant_cfg("mxfp4"))
    assert list(a.state_dict()) == list(b.state_dict())
