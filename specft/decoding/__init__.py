"""Speculative decoding over a Hugging Face target (quantized by specft.quant) and a
trained draft: chain drafting, greedy or rejection-sampling verification, KV caches for
both models with per-row rollback, batches whose rows accept different lengths."""

from specft.decoding.engine import DecodeResult, DecodeStats, SpecDecoder
from specft.decoding.sampling import SamplingConfig

__all__ = ["DecodeResult", "DecodeStats", "SamplingConfig", "SpecDecoder"]
