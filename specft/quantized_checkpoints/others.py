"""Families detected but not run yet: a checkpoint of one is refused in one line naming
it, never loaded as if it were 16-bit (transformers would dequantize some of them and
then run activations in full precision without a word)."""

from __future__ import annotations

from pathlib import Path

from specft.quantized_checkpoints.base import CHECKPOINT_FORMATS, FormatFamily, read_config


class _ByQuantMethod(FormatFamily):
    supported = False
    quant_methods: tuple[str, ...] = ()

    def detect(self, model_dir: Path) -> bool:
        if not (model_dir / "config.json").is_file():
            return False
        method = (read_config(model_dir).get("quantization_config") or {}).get("quant_method")
        return method in self.quant_methods


class _ByFile(FormatFamily):
    supported = False
    pattern = ""

    def detect(self, model_dir: Path) -> bool:
        return any(model_dir.glob(self.pattern))


def _register(name: str, cls: type, **attrs) -> None:
    CHECKPOINT_FORMATS.register(name)(type(name, (cls,), {"name": name, **attrs})())


_register("hf-fp8", _ByQuantMethod, quant_methods=("fp8",))  # Qwen3-*-FP8: block-wise FP8
_register("hf-mxfp4", _ByQuantMethod, quant_methods=("mxfp4",))  # gpt-oss
for _method in ("gptq", "awq", "autoround", "bitsandbytes", "hqq", "quark"):  # transformers' other loaders
    _register(_method, _ByQuantMethod, quant_methods=(_method,))
_register("modelopt", _ByFile, pattern="hf_quant_config.json")
_register("msmodelslim", _ByFile, pattern="quant_model_description*.json")
_register("gguf", _ByFile, pattern="*.gguf")
