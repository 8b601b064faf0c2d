"""Quantized checkpoints as they are served: ``quant=checkpoint``.

A quantizer (llm-compressor, ModelOpt, msModelSlim, llama.cpp's tools) writes a checkpoint
whose files say how it is served: low-bit weights with their scales, and how activations
(and the KV cache) are quantized at run time. specft runs that model, not its own
emulation of the nominal format: each format family (one module here, registered in
CHECKPOINT_FORMATS) detects its files, dequantizes the weights exactly as the format
defines them, and installs the run-time activation quantization the checkpoint records.

Families a user may meet but specft does not run yet are registered too, so that such a
checkpoint is named in one line with the supported ones instead of loading wrong.
"""

# The families register themselves on import.
from specft.quantized_checkpoints import (  # noqa: E402,F401,I001
    compressed_tensors,
    gguf_family,
    gpt_oss,
    gptq,
    hf_fp8,
    modelopt,
    msmodelslim,
    others,
)
from specft.quantized_checkpoints.base import (
    CHECKPOINT_FORMATS,
    CheckpointQuant,
    FormatFamily,
    read_config,
)
from specft.quantized_checkpoints.detect import (
    check_unquantized,
    description_patterns,
    detect_family,
    family_of_method,
    open_checkpoint,
    stored_bits,
    supported,
)

__all__ = ["CHECKPOINT_FORMATS", "CheckpointQuant", "FormatFamily", "check_unquantized", "description_patterns",
           "detect_family", "family_of_method", "open_checkpoint", "read_config", "stored_bits", "supported"]
