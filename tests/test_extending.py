"""docs/extending.md's promise: a new draft architecture, loss and element format each
register from their own code, with nothing else in specft edited, and the whole job
(stage 1 with the new format, training with the new head and loss, `specft eval`
decoding with it) runs through them."""

import json
import sys

import pytest
import torch
from torch import nn

from specft.drafts import DRAFT_ARCHS, DraftArch, DraftOutput, register_draft
from specft.drafts.layers import RMSNorm, SwiGLU
from specft.drafts.vocab import register_vocab_buffers
from specft.quant.formats import ELEMENT_FORMATS, FloatFormat
from specft.train.losses import LOSSES


class ToyDraft(nn.Module):
    """A draft with no attention: step 0 reads fc(aux features); every step adds an MLP
    of norm(token embedding + hidden). Decoding runs these same steps (ChainRunner)."""

    architecture = "toy"

    def __init__(self, c, embed_tokens, draft_to_target):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(c.num_aux_layers * c.hidden_size, c.hidden_size, bias=False)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens.float().clone(), freeze=True)
        register_vocab_buffers(self, draft_to_target, c.target_vocab_size)

    def start_hidden(self, aux, final):
        return self.fc(aux.to(self.fc.weight.dtype))

    def decode_step(self, emb, hidden, attend):
        return hidden + self.mlp(self.norm(emb + hidden))

    def logits(self, hidden):
        return self.lm_head(self.norm(hidden))

    def attention_modules(self):
        return []

    def forward(self, input_ids, aux_hidden, final_hidden, steps):
        hidden, t, out = self.start_hidden(aux_hidden, final_hidden), input_ids.shape[1], DraftOutput([], [])
        for j in range(steps):
            emb = self.embed_tokens(nn.functional.pad(input_ids[:, j + 1:], (0, j + 1)))
            hidden = self.decode_step(emb, hidden, None)
            out.hidden.append(hidden)
            out.logits.append(self.logits(hidden))
        assert t == hidden.shape[1]
        return out


def half_l1(x):
    """A toy loss: half the L1 distance between the draft's and the target's distributions."""
    return 0.5 * (torch.softmax(x.draft_logits, -1) - x.target_probs).abs().sum(-1)


@pytest.fixture
def toys():
    register_draft("toy", DraftArch(
        build=lambda c, head, vocab: ToyDraft(c, head["embed_tokens"], vocab.draft_to_target),
        empty=lambda c: ToyDraft(c, torch.zeros(c.target_vocab_size, c.hidden_size), torch.arange(c.draft_vocab_size)),
        layouts=()))
    LOSSES.register("half_l1")(half_l1)
    ELEMENT_FORMATS["e3m2"] = FloatFormat("e3m2", ebits=3, mbits=2, bias=3, max_value=28.0)  # OCP FP6
    argv = sys.argv[:]
    yield
    sys.argv = argv
    torch.set_flush_denormal(False)  # the in-process trainer flushes subnormals; later tests need them
    DRAFT_ARCHS._entries.pop("toy")
    LOSSES._entries.pop("half_l1")
    ELEMENT_FORMATS.pop("e3m2")


def test_a_toy_architecture_loss_and_format_run_the_whole_job(toys, tmp_path, monkeypatch):
    from specft.cli import main

    monkeypatch.chdir(tmp_path)
    common = ["model=tiny_qwen3", "quant=fp8", "quant.name=fp6", "quant.weight.format=e3m2", "draft.name=toy",
              "data.num_samples=16", f"run_dir={tmp_path / 'run'}", f"cache.root={tmp_path / 'cache'}"]
    assert main(["train", *common, "loss.name=half_l1", "trainer.max_steps=3"]) == 0
    meta = json.loads((tmp_path / "run/checkpoints/final/draft_config.json").read_text())
    assert meta["architecture"] == "toy" and meta["quant"] == "fp6"
    (manifest,) = (tmp_path / "cache").glob("*/manifest.json")
    assert json.loads(manifest.read_text())["provenance"]["quant"]["weight"]["format"] == "e3m2"
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics) and metrics[-1]["split"] == "val"
    assert main(["eval", *common, "eval.k=[2]", "eval.num_prompts=2", "eval.max_new_tokens=6"]) == 0
    results = json.loads((tmp_path / "run/eval/results.json").read_text())["results"]
    assert [(r["draft"], r["k"]) for r in results] == [("target alone", 0), ("run", 2)]
    assert results[1]["proposed"] > 0
    assert main(["train", "model=tiny_qwen3", "draft.name=toy2"]) == 2  # unknown names still refused
