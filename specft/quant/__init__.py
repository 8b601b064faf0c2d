"""Low-bit number formats, fake quantization and applying them to models."""

from specft.quant.apply import QuantReport, apply_quant
from specft.quant.fake_quant import TensorQuantSpec, fake_quant, fake_quant_ste
from specft.quant.formats import ELEMENT_FORMATS, get_format

__all__ = ["ELEMENT_FORMATS", "QuantReport", "TensorQuantSpec", "apply_quant", "fake_quant",
           "fake_quant_ste", "get_format"]
