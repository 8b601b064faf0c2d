"""Low-bit number formats, fake quantization and applying them to models."""

from specft.quant.apply import QuantReport, apply_quant, calibrate
from specft.quant.config import QuantConfig
from specft.quant.fake_quant import TensorQuantSpec, fake_quant, fake_quant_ste
from specft.quant.formats import ELEMENT_FORMATS, get_format

__all__ = ["ELEMENT_FORMATS", "QuantConfig", "QuantReport", "TensorQuantSpec", "apply_quant",
           "calibrate", "fake_quant", "fake_quant_ste", "get_format"]
