"""The target model: loading, quantizing, and capturing its hidden states."""

from specft.target_model.features import FeatureCapture
from specft.target_model.loader import load_target, load_tokenizer

__all__ = ["FeatureCapture", "load_target", "load_tokenizer"]
