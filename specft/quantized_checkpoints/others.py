"""Families detected but not run yet: a checkpoint of one is refused in one line naming
it, never loaded as if it were 16-bit (transformers would dequantize some of them and
then run activations in full precision without a word)."""

from __future__ import annotations

from pathlib import Path

from specft.quantized_checkpoints.base import CHECKPOINT_FORMATS, FormatFamily, read_config


class ByQuantMethod(FormatFamily):
    """Known by ``quantization_config.quant_method`` in config.json."""

    supported = False

    def __init__(self, name: str, method: str):
        self.name, self.method = name, method

    def detect(self, model_dir: Path) -> bool:
        if not (model_dir / "config.json").is_file():
            return False
        return (read_config(model_dir).get("quantization_config") or {}).get("quant_method") == self.method


# quant_method -> the family's name: gpt-oss MXFP4 and
# transformers' other loaders
for method, name in (("mxfp4", "hf-mxfp4"), ("autoround", "autoround"), ("bitsandbytes", "bitsandbytes"), ("hqq", "hqq"),
                     ("quark", "quark")):
    CHECKPOINT_FORMATS.register(name)(ByQuantMethod(name, method))
