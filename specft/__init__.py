"""specft: train speculative-decoding draft heads aligned with low-bit quantized targets."""

__version__ = "0.1.0"
