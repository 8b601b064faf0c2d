"""Tiny random-weight Qwen3 / Qwen3-MoE targets, built locally for fast tests.

The tokenizer is a byte-level BPE trained here on the synthetic prompt source, with the
Qwen3 special tokens and a Qwen3-style ChatML template, so the chat and mask code paths
are the real ones. Everything is seeded: the same config builds the same checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specft.config import ModelConfig
from specft.target_model.local_checkpoint import ensure_checkpoint_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# ChatML with Qwen3's thinking rules (written here, same behaviour): an assistant turn
# after the last user message shows its reasoning in a <think> block (empty when it has
# none); earlier turns drop it; enable_thinking=false pre-fills an empty block in the
# generation prompt.
CHATML_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] -%}{%- set reasoning = m.get('reasoning_content') or '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() -%}"
    "{%- set content = content.split('</think>')[-1].lstrip() -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) -%}"
    "{{- '<think>\n' + reasoning.strip() + '\n</think>\n\n' -}}"
    "{%- endif -%}"
    "{{- content + '<|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}{%- endif -%}"
)


def _tokenizer_corpus(n: int = 3000) -> list[str]:
    from specft.target_model.word_problems import synthetic_conversations

    texts = []
    for conv in synthetic_conversations(n, seed=12345):
        texts.extend(m["content"] for m in conv)
    return texts


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None)
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _hf_config(cfg: ModelConfig):
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  max_position_embeddings=4096, tie_word_embeddings=cfg.tie_word_embeddings,
                  eos_token_id=None, pad_token_id=None, bos_token_id=None,
                  # Wider than the default 0.02 so the random target's next-token
                  # distribution is peaked enough to be worth imitating.
                  initializer_range=0.25)
    if cfg.family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(intermediate_size=cfg.intermediate_size, **common)
    if cfg.family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(moe_intermediate_size=cfg.intermediate_size,
                              intermediate_size=cfg.intermediate_size * 2,
                              num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_top_k,
                              decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                              **common)
    raise ValueError(f"no tiny builder for family {cfg.family!r}")


# The fields that shape a tiny model's weights.
SHAPE_FIELDS = ("family", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                "head_dim", "vocab_size", "num_experts", "experts_top_k", "tie_word_embeddings")


def tiny_dir_name(cfg: ModelConfig) -> str:
    """The build folder's name: the config's name plus a digest of its shape, so an
    override (model.head_dim=32) builds its own model instead of reusing one of another
    shape under the same name."""
    import hashlib

    shape = repr([getattr(cfg, f) for f in SHAPE_FIELDS]).encode()
    return f"{cfg.name}-{hashlib.sha256(shape).hexdigest()[:8]}"


def build_tiny(cfg: ModelConfig, out_dir: Path, seed: int = 0) -> Path:
    """Build and save a tiny model + tokenizer at ``out_dir`` (once; see local_checkpoint)."""

    def write(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM

        tokenizer = build_tokenizer(cfg.vocab_size)
        hf_config = _hf_config(cfg)
        hf_config.eos_token_id = tokenizer.eos_token_id
        hf_config.pad_token_id = tokenizer.pad_token_id
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return ensure_checkpoint_dir(out_dir, write)
