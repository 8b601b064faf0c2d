"""The EAGLE-3 draft head.

fc fuses 3 target layers (3H -> H). Each draft step embeds the next token, concatenates
norm(embedding) and norm(hidden) (2H), runs one decoder layer whose q/k/v read 2H, and
predicts over a reduced draft vocabulary. Module names follow the EAGLE-3 checkpoints
that vLLM and SGLang load (fc, midlayer.*, norm, lm_head, d2t, t2d).

Training-time test (TTT) unrolls k steps: step j at position p reads token x[p+j+1] and
the draft's own hidden state from step j-1, sits at position p+j (RoPE uses the real
position, as in chain drafting), and attends to the step-0 keys at positions <= p plus
its own chain's keys from steps 1..j.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specft.drafts.layers import AttentionProjections, DraftHeadConfig, DraftOutput, RMSNorm, SwiGLU
from specft.drafts.vocab import register_vocab_buffers


class Eagle3Attention(AttentionProjections):
    def ttt_attention(self, q, keys: list, values: list) -> torch.Tensor:
        """q [B, h, T, d]; keys/values[0] are the step-0 (context) keys, attended
        causally; keys[1:] are this chain's later steps, attended on the diagonal."""
        scale = 1.0 / math.sqrt(self.c.head_dim)
        t = q.shape[2]
        scores0 = (q @ keys[0].transpose(-1, -2)) * scale
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores0 = scores0.masked_fill(~causal, float("-inf"))
        diag = [((q * k).sum(-1) * scale)[..., None] for k in keys[1:]]
        probs = torch.softmax(torch.cat([scores0, *diag], dim=-1), dim=-1)
        out = probs[..., :t] @ values[0]
        for i, v in enumerate(values[1:]):
            out = out + probs[..., t + i: t + i + 1] * v
        return self.out(out)


class Eagle3Layer(nn.Module):
    """A decoder layer with TTT attention. The first layer reads [norm(embedding);
    norm(hidden)] (2H); later layers (draft.num_layers > 1) read norm(hidden) (H)."""

    def __init__(self, c: DraftHeadConfig, first: bool = True):
        super().__init__()
        self.first = first
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c, (2 if first else 1) * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def step(self, emb: torch.Tensor, hidden: torch.Tensor, attend) -> torch.Tensor:
        """The layer around its attention, for training and decoding alike: ``attend(x)``
        maps the attention input to o_proj's output (a TTT unroll, or a decoding cache)."""
        if self.first:
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        else:
            x = self.input_layernorm(hidden)
        h = hidden + attend(x)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, emb, hidden, positions, keys: list, values: list):
        """One TTT step; appends this step's k/v to ``keys``/``values``."""
        def attend(x):
            q, k, v = self.self_attn.qkv(x, positions)
            keys.append(k)
            values.append(v)
            return self.self_attn.ttt_attention(q, keys, values)

        return self.step(emb, hidden, attend)


class Eagle3Draft(nn.Module):
    architecture = "eagle3"  # draft_config.json's architecture: the registry key

    def __init__(self, c: DraftHeadConfig, embed_tokens: torch.Tensor, draft_to_target: torch.Tensor):
        super().__init__()
        self.config = c
        target_hidden = c.target_hidden_size or c.hidden_size
        self.fc = nn.Linear(c.num_aux_layers * target_hidden, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.extra_layers = nn.ModuleList(Eagle3Layer(c, first=False) for _ in range(c.num_layers - 1))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        if embed_tokens.shape[1] == c.hidden_size:
            # The target's embedding, frozen: copied, never trained.
            self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens.float().clone(), freeze=True)
        else:  # a draft narrower or wider than the target learns its own embedding
            self.embed_tokens = nn.Embedding(embed_tokens.shape[0], c.hidden_size)
            nn.init.normal_(self.embed_tokens.weight, std=0.02)
        register_vocab_buffers(self, draft_to_target, c.target_vocab_size)

    @property
    def layers(self) -> list[Eagle3Layer]:
        return [self.midlayer, *self.extra_layers]

    def start_hidden(self, aux_hidden: torch.Tensor, final_hidden: torch.Tensor | None) -> torch.Tensor:
        """Step 0's hidden input: fc over the target's fused aux features."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))  # bf16 training casts the module

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def attention_modules(self) -> list[Eagle3Attention]:
        return [layer.self_attn for layer in self.layers]

    def decode_step(self, emb: torch.Tensor, hidden: torch.Tensor, attend) -> torch.Tensor:
        """One chain-drafting step: every layer's own step, ``attend(i, x)`` its attention."""
        for i, layer in enumerate(self.layers):
            hidden = layer.step(emb, hidden, lambda x, i=i: attend(i, x))
        return hidden

    def step_inputs(self, j: int, input_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """TTT step j's (token embedding, hidden input) at every position p: token x[p+j+1]
        and the previous step's output (step 0: fc of the target features), as chain
        drafting feeds them."""
        return self.embed_tokens(F.pad(input_ids[:, j + 1:], (0, j + 1), value=0)), hidden

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, final_hidden: torch.Tensor | None,
                steps: int) -> DraftOutput:
        """TTT unroll for steps 0..steps-1: draft logits [B, T, Vd] and hidden states
        [B, T, H]. Step j at position p predicts token x[p+j+2], i.e. matches the
        target's distribution at p+j+1."""
        hidden = self.start_hidden(aux_hidden, final_hidden)
        t = input_ids.shape[1]
        layers = self.layers
        keys, values = [[] for _ in layers], [[] for _ in layers]  # per layer, per step
        out = DraftOutput([], [])
        for j in range(steps):
            positions = torch.arange(j, t + j, device=input_ids.device)
            emb, hidden = self.step_inputs(j, input_ids, hidden)
            for i, layer in enumerate(layers):
                hidden = layer(emb, hidden, positions, keys[i], values[i])
            out.hidden.append(hidden)
            out.logits.append(self.logits(hidden))
        return out
