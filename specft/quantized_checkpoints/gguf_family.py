"""GGUF files (llama.cpp) as llama.cpp's CPU build serves them: ``model.path=FILE.gguf
quant=checkpoint``.

- Weights: dequantized by the ``gguf`` package (llama.cpp's own Python reference), through
  transformers' GGUF reader for the names and llama's Q/K row order. Exact.
- Activations: each linear layer's input rounded as ggml rounds it for that weight's type
  (ggml_activations.py): F16, Q8_0, Q8_1 (with the block sums Q4_1/Q5_1 add), Q8_K.
- Attention: keys and values rounded to F16 after RoPE (the default F16 KV cache); queries,
  softmax and the weighted sum in float32. That is llama.cpp's tiled flash-attention kernel,
  which runs every ubatch of 64 or more query rows (prompt processing, the teacher-forced
  sequences of stage 1). Shorter ubatches (decoding, a speculative verify pass) take its
  one-row kernel, which rounds the query to F16 and accumulates the values in F16; specft
  does not emulate that path (docs/checkpoints.md measures what it costs).

The target computes in float32 whatever model.dtype says: llama.cpp's CPU path is float32
around the quantized products.
"""

from __future__ import annotations

import logging
import re
import struct
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specft.common.errors import SpecftError
from specft.quantized_checkpoints.base import (
    CHECKPOINT_FORMATS,
    CheckpointQuant,
    FormatFamily,
    LayerQuant,
)
from specft.quantized_checkpoints.ggml_activations import (
    ACTIVATIONS,
    VEC_DOT_TYPE,
    GgmlInput,
    f16,
    q8_1_correction,
)

log = logging.getLogger(__name__)

# llama.cpp's per-layer tensor -> the transformers module it is (dense Llama / Qwen3)
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# tensors read only as lookups or elementwise (no activation quantization)
NOT_MATMULS = re.compile(r"(token_embd|.*norm|rope_freqs)\.weight$")
ARCHITECTURES = ("llama", "qwen3")
CAUSAL_LM_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# bytes of one block and the offset of its F16 minimum, for the types whose product adds
# min * s (Q8_1's block sum)
BLOCK_MINS = {"Q4_1": (20, 2), "Q5_1": (24, 2)}


def is_gguf_file(path) -> bool:
    """``model.path`` names a .gguf file (run as llama.cpp serves it)."""
    return str(path).endswith(".gguf") and Path(path).expanduser().is_file()


def _module_name(tensor_name: str) -> str | None:
    if tensor_name == "output.weight":
        return "lm_head"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", tensor_name)
    if m and m.group(2) in LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{LAYER_TENSORS[m.group(2)]}"
    return None


class Q81Linear:
    """A Q4_1/Q5_1 product as ggml computes it: the weight times the Q8_1 activation plus
    each block's minimum times the difference between the stored F16 block sum and the
    dequantized one."""

    def __init__(self, module: nn.Linear, mins: torch.Tensor):
        self.module, self.mins = module, mins

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xq, correction = q8_1_correction(x)
        out = nn.functional.linear(xq, self.module.weight, self.module.bias)
        return out + nn.functional.linear(correction.to(out.dtype), self.mins.to(out.dtype))


class GgufFile(FormatFamily):
    name = "gguf"

    def detect(self, model_dir: Path) -> bool:
        """A .gguf file, or a directory of them without a config.json."""
        model_dir = Path(model_dir)
        if model_dir.is_file():
            return model_dir.suffix == ".gguf"
        return not (model_dir / "config.json").is_file() and any(model_dir.glob("*.gguf"))

    def open(self, model_dir: Path) -> CheckpointQuant:
        path = gguf_path(Path(model_dir))
        reader = _reader(path)
        arch = check_header(path, reader)
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        _check_types(path, types)
        kinds = sorted({v for k, v in types.items() if not NOT_MATMULS.fullmatch(k)} - {"F32"})
        ckpt = CheckpointQuant(self.name, path.parent, f"GGUF {arch}: {', '.join(kinds)} weights, "
                               "ggml activation rounding, F16 KV cache")
        ckpt.gguf_file = path
        ckpt.tensor_types = types
        ckpt.load_config = lambda: hf_config(path, reader)
        ckpt.load_state = lambda model, dtype: _load_state(ckpt, reader, model)
        ckpt.attention.append(_f16_kv_cache)
        ckpt.compute_dtype = torch.float32
        return ckpt


def _f16_kv_cache(query, key, value):
    return query, f16(key), f16(value)


_f16_kv_cache.description = "keys and values in F16 (llama.cpp's default KV cache)"


def gguf_path(where: Path) -> Path:
    if where.suffix == ".gguf":
        return where
    files = sorted(where.glob("*.gguf"))
    if len(files) != 1:
        raise SpecftError(f"model.path: {where} holds {len(files)} .gguf files; give model.path=FILE.gguf")
    return files[0]


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as err:  # noqa: BLE001 - gguf's parser of an untrusted file: whatever it raises (an
        # IndexError on a cut string, a KeyError on an unknown value type) means the file does not read
        raise SpecftError(f"model.path: {path} is not a readable GGUF file ({type(err).__name__}: "
                          f"{str(err)[:200]})") from None


def _field(reader, key: str):
    field = reader.get_field(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if value.dtype == np.uint8 else value.item()


# Token-embedding types after which llama.cpp's layers part from specft's emulation, cause
# not found: with an IQ4_XS token_embd and Q8_K-rounded attention products, llama.cpp 11434's
# layer-1 input differs by ~0.6-1.0 (mean |error|, ~2% of its size) where every other
# pairing measured 0.02-0.07 (each product alone agrees with libggml to 1e-5; docs/checkpoints.md).
UNMATCHED_EMBEDDINGS = {"IQ4_XS"}


def _check_types(path: Path, types: dict[str, str]) -> None:
    embedding = types.get("token_embd.weight")
    if embedding in UNMATCHED_EMBEDDINGS:
        raise SpecftError(f"quant=checkpoint: {path.name}: its token embedding is {embedding}, after which specft "
                          "does not yet compute what llama.cpp does; requantize with llama-quantize "
                          "--token-embedding-type q8_0 (the other tensors may stay as they are)")
    for name, kind in types.items():
        if NOT_MATMULS.fullmatch(name):
            continue
        if kind not in VEC_DOT_TYPE:
            raise SpecftError(f"quant=checkpoint: {path.name}: {name} is {kind}, a GGUF type specft cannot run "
                              f"exactly as llama.cpp does; supported: {', '.join(VEC_DOT_TYPE)}")
        if _module_name(name) is None:
            raise SpecftError(f"quant=checkpoint: {path.name}: tensor {name} ({kind}) has no place in the dense "
                              "models specft runs from GGUF (Mixture-of-Experts GGUFs are not supported yet, MXFP4_MOE "
                              "ones included)")


def check_header(path: Path, reader) -> str:
    """The header facts specft needs before anything reads the file further (transformers'
    GGUF reader included, which raises on what it does not know): an architecture specft
    runs, a tokenizer, and one token per embedding row. Returns the architecture."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise SpecftError(f"quant=checkpoint: {path.name} is a GGUF of architecture {arch}; specft runs "
                          f"{', '.join(ARCHITECTURES)} GGUFs as llama.cpp does (docs/checkpoints.md)")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None:
        raise SpecftError(f"model.path: {path.name} holds no tokenizer (no tokenizer.ggml.tokens); convert the model "
                          "again with llama.cpp's convert_hf_to_gguf.py, which writes it")
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    rows = int(embedding.shape[1]) if embedding is not None and len(embedding.shape) > 1 else None
    if rows is not None and rows != len(tokens.data):
        raise SpecftError(f"model.path: {path.name}'s tokenizer lists {len(tokens.data)} tokens and its embedding has "
                          f"{rows} rows; the file is damaged or was assembled by hand: convert the model again")
    return arch


def hf_config(path: Path, reader=None):
    """The transformers config a GGUF's header describes. transformers maps no head width
    from a GGUF, so a Qwen3 would get Qwen3Config's default 128 whatever the file says:
    it is taken from ``{arch}.attention.key_length`` (``reader``: the file's, when open)."""
    from transformers import AutoConfig

    reader = reader or _reader(path)
    check_header(path, reader)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError, struct.error) as err:
        raise SpecftError(f"model.path: {path} is not a readable GGUF file ({err})") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    head_dim = _field(reader, f"{_field(reader, 'general.architecture')}.attention.key_length")
    if head_dim is not None and hasattr(config, "head_dim"):
        config.head_dim = int(head_dim)
    # the model class, which transformers leaves out too (llama.cpp's converter reads it
    # from a draft's target directory)
    config.architectures = config.architectures or [CAUSAL_LM_CLASSES[config.model_type]]
    return config


def _load_state(ckpt: CheckpointQuant, reader, model: nn.Module) -> dict[str, torch.Tensor]:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    state = load_gguf_checkpoint(str(ckpt.gguf_file), return_tensors=True, model_to_load=model)["tensors"]
    state = {k: v.to(torch.float32) for k, v in state.items()}
    tied = "output.weight" not in ckpt.tensor_types
    for name, kind in ckpt.tensor_types.items():
        module_name = "lm_head" if tied and name == "token_embd.weight" else _module_name(name)
        if module_name is None or kind == "F32":
            continue
        module = model.get_submodule(module_name)
        vec_dot = VEC_DOT_TYPE[kind]
        layer = LayerQuant(module_name, f"gguf {kind}", f"ggml {vec_dot}")
        if vec_dot == "Q8_1":
            layer.forward = Q81Linear(module, _block_mins(reader, name, kind, model.config))
        else:
            layer.quantize_input = GgmlInput(vec_dot, ACTIVATIONS[vec_dot][1])
        ckpt.layers[module_name] = layer
    return state


def _block_mins(reader, name: str, kind: str, config) -> torch.Tensor:
    """The F16 minimum of every block of a Q4_1/Q5_1 tensor, [rows, blocks], rows in the
    order transformers gives the weight (llama's Q/K rows un-permuted the same way)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    tensor = next(t for t in reader.tensors if t.name == name)
    block_bytes, offset = BLOCK_MINS[kind]
    raw = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1, block_bytes)
    mins = raw[:, :, offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    if config.model_type == "llama":
        processor = LlamaTensorProcessor(config={"num_attention_heads": config.num_attention_heads,
                                                 "num_key_value_heads": config.num_key_value_heads})
        mins = processor.process(mins, name).weights
    return torch.from_numpy(np.ascontiguousarray(mins))


CHECKPOINT_FORMATS.register("gguf")(GgufFile())
