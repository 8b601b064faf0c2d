"""Quantized checkpoints as they are served (``quant=checkpoint``): a quantizer's files say
how its model is served (low-bit weights and scales, activations and KV cache quantized at
run time), and specft runs that model, not its emulation of the nominal format. Each
family is one module here, registered in CHECKPOINT_FORMATS: it detects its files,
dequantizes the weights as the format defines them and installs the run-time quantization
the checkpoint records. Families specft does not run yet are registered too (others.py),
so such a checkpoint is named in one line instead of loading wrong."""

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
