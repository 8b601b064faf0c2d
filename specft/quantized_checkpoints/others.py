"""Families detected but not run yet: a checkpoint of one is refused in one line naming
it, never loaded as if it were 16-bit (transformers would dequantize some of them and
then run activations in full precision without a word)."""

from __future__ import annotations

from specft.quantized_checkpoints.base import CHECKPOINT_FORMATS, QuantMethodFamily


class ByQuantMethod(QuantMethodFamily):
    """Known by ``quantization_config.quant_method`` in config.json."""

    supported = False

    def __init__(self, name: str, method: str):
        self.name, self.method = name, method


# quant_method -> the family's name: transformers' other loaders
for method, name in (("autoround", "autoround"), ("bitsandbytes", "bitsandbytes"), ("hqq", "hqq"), ("quark", "quark")):
    CHECKPOINT_FORMATS.register(name)(ByQuantMethod(name, method))
