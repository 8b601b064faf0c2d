"""A tiny gpt-oss checkpoint in gpt-oss's own MXFP4 layout (``quant_method: mxfp4``), for
specft's quant=checkpoint tests. Imports nothing from specft.

No tool writes this layout on a CPU: OpenAI's and transformers' MXFP4 quantizers need
triton kernels on a GPU. So this script builds a gpt-oss model with random weights from
transformers' GptOssConfig (8 layers, 4 experts, 2 active, hidden 64) and writes the
experts as the released checkpoints store them: ``<proj>_blocks`` [E, rows, K / 32, 16]
(two E2M1 codes a byte, the low nibble first) and ``<proj>_scales`` [E, rows, K / 32]
(E8M0, bias 127), rows and K those of the Linear the projection is
(gate_up_proj: 2I rows of H inputs, gate and up interleaved; down_proj: H rows of I).
Each group of 32 gets the OCP MX scale 2^(floor(log2(amax)) - 2); the codes are the
ratios rounded by ml_dtypes' float4_e2m1fn (ties to even), saturated at 6. Everything else
stays bfloat16. The tests' oracle is transformers' own reading of the file
(``Mxfp4Config(dequantize=True)``), not this script's arithmetic.

    python scripts/make_gpt_oss_fixture.py --tokenizer tests/fixtures/checkpoints/tiny_qwen3_hf_fp8 \\
        --out tests/fixtures/checkpoints/tiny_gpt_oss_mxfp4
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
GROUP = 32


def to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [..., rows, K/32, 16], scales uint8 [..., rows, K/32]) of ``weight``
    [..., rows, K]."""
    groups = weight.to(torch.float32).unflatten(-1, (-1, GROUP))
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
    ratios = (groups / torch.exp2(exponent).unsqueeze(-1)).clamp(-6, 6).numpy()
    codes = ratios.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.from_numpy(packed.astype(np.uint8)), (exponent + 127).to(torch.uint8)


def build(out: Path, tokenizer_dir: Path, vocab: int) -> dict:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          vocab_size=vocab, sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 4,
                          max_position_embeddings=4096, initializer_range=0.25)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tensors, experts = {}, []
    for name, value in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module.endswith(".experts") and leaf in ("gate_up_proj", "down_proj"):
            # stored as the Linear it is: [E, out, in] (transformers keeps [E, in, out])
            blocks, scales = to_mxfp4(value.transpose(1, 2))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
            experts.append(name)
        else:
            tensors[name] = value.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    saved = config.to_dict()
    # as openai/gpt-oss-20b's config.json lists them
    not_converted = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": not_converted}
    (out / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return {"by": "scripts/make_gpt_oss_fixture.py", "experts_mxfp4": experts, "ml_dtypes": ml_dtypes.__version__,
            "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a directory whose tokenizer files are copied")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=2048)
    args = ap.parse_args()
    made = build(args.out, args.tokenizer, args.vocab)
    (args.out / "made.json").write_text(json.dumps(made, indent=2) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
