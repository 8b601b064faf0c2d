"""The decode loop's in-place KV cache against transformers' DynamicCache, and the
quantized-input sharing of linears that read one tensor."""

import torch
from transformers import DynamicCache

from specft.config import RegenerateConfig
from specft.data import load_conversations
from specft.data.template import prompt_ids
from specft.decoding.kv_cache import InPlaceCache
from specft.engines.generate import generate_batch
from specft.quant import apply_quant
from specft.quant.apply import SharedInput
from specft.target_model import load_target

from helpers import quant_cfg, root_cfg


def _model(quant="mxfp4", dtype=torch.float64):
    cfg = root_cfg("model=tiny_qwen3", f"quant={quant}")
    m, tok = load_target(cfg.model)
    apply_quant(m, cfg.quant)
    return m.to(dtype).eval(), tok, cfg


@torch.no_grad()
def test_in_place_cache_gives_the_logits_dynamic_cache_gives():
    """Prefill, decode steps past the first buffer's room (so it grows), a crop of the
    last columns and a dropped row: every logit equal to DynamicCache's."""
    m, _, _ = _model()
    ids = torch.randint(0, m.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    caches = [DynamicCache(), InPlaceCache(room=2)]
    outs = [m(input_ids=ids, cache=c, use_cache=True).logits for c in caches]
    assert torch.equal(outs[0], outs[1])
    tok = outs[0][:, -1:].argmax(-1)
    for step in range(6):
        outs = [m(input_ids=torch.cat([tok, tok], 1), cache=c, use_cache=True).logits for c in caches]
        assert torch.equal(outs[0], outs[1]), step
        for c in caches:
            c.crop(-1)  # the second column was a rejected draft
        tok = outs[0][:, :1].argmax(-1)
        if step == 3:
            for c in caches:
                c.batch_select_indices(torch.tensor([0, 2]))
            tok = tok[[0, 2]]
    assert caches[1].get_seq_length() == caches[0].get_seq_length() == 9 + 6
    assert caches[1].layers[0].keys.shape == caches[0].layers[0].keys.shape
    used = sum(t.numel() * t.element_size() for layer in caches[0].layers for t in (layer.keys, layer.values))
    assert used <= caches[1].allocated_bytes() <= 2 * used  # memory counts the room, which stays bounded


def test_linears_reading_one_tensor_quantize_it_once():
    m, _, _ = _model(dtype=torch.float32)
    calls = []
    real = SharedInput.__call__

    def spy(self, quant, x):
        before = self.out
        out = real(self, quant, x)
        calls.append(out is before)  # served the previous call's quantized copy
        return out

    SharedInput.__call__ = spy
    try:
        with torch.no_grad():
            m(input_ids=torch.tensor([[1, 2, 3]]))
    finally:
        SharedInput.__call__ = real
    layers = m.config.num_hidden_layers
    assert len(calls) == 7 * layers  # q, k, v, o, gate, up, down
    assert sum(calls) == 3 * layers  # k and v reuse q's quantized input, up reuses gate's


def test_a_changed_input_is_quantized_again():
    shared = SharedInput()
    from specft.quant.apply import ActivationQuantizer

    q = ActivationQuantizer(quant_cfg("fp8").activation)
    x = torch.randn(2, 64)
    first = shared(q, x)
    assert shared(q, x) is first
    x.mul_(3)  # same tensor, new values: its version counter moved
    again = shared(q, x)
    assert again is not first and not torch.equal(again, first)


def test_regeneration_samples_reproducibly_and_stops_at_eos():
    m, tok, cfg = _model(dtype=torch.float32)
    prompts = [prompt_ids(tok, c[:1]) for c in load_conversations(cfg.data)[:4]]
    rc = RegenerateConfig(max_new_tokens=10, temperature=1.0, top_k=20)
    a, capped = generate_batch(m, tok, prompts, rc, seed=3)
    b, _ = generate_batch(m, tok, prompts, rc, seed=3)
    c, _ = generate_batch(m, tok, prompts, rc, seed=4)
    assert a == b and a != c
    assert all(tok.eos_token_id not in ans for ans in a)
    assert all(len(ans) == 10 for ans, cap in zip(a, capped) if cap)


@torch.no_grad()
def test_the_head_sees_a_contiguous_last_position():
    """logits_to_keep=1 slices the last position as a strided view; the loader's hook hands
    the head a contiguous copy (else PyTorch's matmul copies the weight once per row) and
    the logits are the full forward's last position."""
    m, _, _ = _model(dtype=torch.float32)
    seen = []
    handle = m.get_output_embeddings().register_forward_pre_hook(lambda mod, a: seen.append(a[0].is_contiguous()))
    ids = torch.randint(0, m.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(1))
    try:
        last = m(input_ids=ids, logits_to_keep=1).logits
        full = m(input_ids=ids).logits
    finally:
        handle.remove()
    assert seen == [True, True]
    torch.testing.assert_close(last[:, 0], full[:, -1], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_compacting_holes_keeps_every_logit_and_bounds_the_cache(monkeypatch):
    """Rows that keep different numbers of verified columns leave holes; when the next
    forward would not fit, the runner moves each row's kept columns together instead of
    growing the buffer. Logits match a runner that never compacts (float64), and the
    compacting one ends with fewer columns and a smaller buffer."""
    from specft.decoding.target import Engine

    m, _, _ = _model()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, m.config.vocab_size, (3, 6), generator=g)
    valid = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [0] * 5 + [1]])  # left padding: holes too
    runners = {"compacts": Engine(m, [1]), "never": Engine(m, [1])}
    never = runners["never"]
    monkeypatch.setattr(never, "_compact", lambda: None)
    for r in runners.values():
        r.reset(3, "cpu", room=5)
        r.forward(prompt, valid)
        r.commit(valid.sum(-1))
    for round_ in range(12):
        fed = torch.randint(0, m.config.vocab_size, (3, 4), generator=g)
        steps = {name: r.forward(fed) for name, r in runners.items()}
        assert torch.allclose(steps["compacts"].logits, steps["never"].logits, rtol=1e-10, atol=1e-10), round_
        assert torch.allclose(steps["compacts"].aux, steps["never"].aux, rtol=1e-10, atol=1e-10)
        keep = torch.randint(1, 5, (3,), generator=g)
        keep[round_ % 3] = 1  # some row always rejects: holes no crop removes
        for r in runners.values():
            r.commit(keep)
    compacts = runners["compacts"]
    assert torch.equal(compacts.next_pos, never.next_pos)
    assert torch.equal(compacts.mask.sum(-1), never.mask.sum(-1))
    assert compacts.mask.shape[1] < never.mask.shape[1]
    assert compacts.kv_bytes() < never.kv_bytes()
