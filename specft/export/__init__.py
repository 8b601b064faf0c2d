"""`specft export`: a trained draft in a layout serving engines load. writers.py dispatches
by layout to safetensors.py (vLLM / SGLang / speculators checkpoints, 16 bit or packed) or
gguf.py (llama.cpp's converter); files.py holds what they share, rotation_fold.py
`specft fold-rotation`."""

from specft.export.files import check_out_dir, write_files_atomically
from specft.export.safetensors import QUANT_KINDS, export_draft
from specft.export.writers import ExportOptions, export

__all__ = ["QUANT_KINDS", "ExportOptions", "check_out_dir", "export", "export_draft", "write_files_atomically"]
