"""GGUF files through llama.cpp's own tools: convert_hf_to_gguf.py for a target or a draft,
llama-quantize for the quantized types. specft writes no GGUF itself."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from specft.common.errors import SpecftError
from specft.llamacpp.install import INSTALL_COMMAND, binary, converter, prefix

GGUF_MAGIC = b"GGUF"


def _run(args: list[str], what: str, env: dict | None = None, timeout_s: float = 3600) -> None:
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout_s)
    if done.returncode != 0:
        last = [ln for ln in (done.stderr or done.stdout).strip().splitlines() if ln.strip()]
        raise SpecftError(f"{what} failed: {_cause(last[-1]) if last else f'exit code {done.returncode}'}")


def _cause(last_line: str) -> str:
    """The tool's last line, with what to do when it says the install is incomplete: a
    module the converter imports is missing (a Python environment the install script did
    not set up), or llama.cpp's own conversion package (a tree of another llama.cpp)."""
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", last_line)
    if not missing:
        return last_line
    module = missing.group(1)
    why = (f"the llama.cpp tree at {prefix()} is not the version specft installs"
           if module.split(".")[0] in ("conversion", "gguf", "convert_hf_to_gguf") else
           "this Python lacks a module llama.cpp's converter imports")
    return f"{last_line} ({why}; run `{INSTALL_COMMAND}` with this Python: it reuses the build and installs " \
           "what the converter needs)"


def _check_written(path: Path, what: str) -> Path:
    """An engine's output is read as untrusted: a tool that exits 0 must have written a
    GGUF file where it was told to."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError:
        head = None
    if head != GGUF_MAGIC:
        found = "no file" if head is None else "a file that is not GGUF"
        raise SpecftError(f"{what} exited 0 but wrote {found} at {path}; the llama.cpp install at {prefix()} "
                          f"misbehaves: rebuild it with `{INSTALL_COMMAND}`")
    return path


# convert_hf_to_gguf.py with its pre-tokenizer answer fixed: it recognizes a tokenizer by a
# hash of its output and refuses one it does not know, but for a target that is already a
# GGUF the answer is written in it (tokenizer.ggml.pre), and the draft must carry the same.
_WITH_PRE_TOKENIZER = """
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as convert
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer, pre=sys.argv[2]: pre
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
convert.main()
"""


def hf_to_gguf(model_dir: Path, out_file: Path, outtype: str = "f16", target_model_dir: Path | None = None,
               pre_tokenizer: str | None = None) -> Path:
    """llama.cpp's converter on an HF checkpoint (a draft needs its target's directory:
    the vocabulary and the target's width come from there)."""
    script, env = converter()
    run = [sys.executable, "-c", _WITH_PRE_TOKENIZER, str(script.parent), pre_tokenizer] if pre_tokenizer else \
        [sys.executable, str(script)]
    args = [*run, str(model_dir), "--outtype", outtype, "--outfile", str(out_file)]
    if target_model_dir is not None:
        args += ["--target-model-dir", str(target_model_dir)]
    _run(args, f"convert_hf_to_gguf.py {model_dir}", env)
    return _check_written(out_file, "convert_hf_to_gguf.py")


def quantize(f16_gguf: Path, out_file: Path, kind: str, threads: int = 2, tensor_types: dict | None = None,
             imatrix: Path | None = None) -> Path:
    """llama-quantize into ``kind``; ``tensor_types`` overrides it per tensor-name pattern
    (``{"attn": "mxfp4", "ffn": "mxfp4"}``: a dense MXFP4 model, whose embedding and head keep
    ``kind``); ``imatrix``: the importance matrix the 2-bit i-quants require."""
    overrides = [arg for pattern, t in (tensor_types or {}).items() for arg in ("--tensor-type", f"{pattern}={t}")]
    with_imatrix = ["--imatrix", str(imatrix)] if imatrix else []
    _run([str(binary("llama-quantize")), *overrides, *with_imatrix, str(f16_gguf), str(out_file), kind, str(threads)],
         f"llama-quantize {kind}")
    return _check_written(out_file, f"llama-quantize {kind}")


def _write_out(writer) -> None:
    """gguf-py's GGUFWriter to its file: header, keys, tensors, in the order the format needs."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def flat_imatrix(f32: Path, out: Path) -> Path:
    """An importance matrix that weighs every input column alike (llama.cpp's GGUF imatrix
    layout: ``<tensor>.in_sum2`` and ``<tensor>.counts`` per weight). The 2- and 3-bit i-quants
    need one to quantize at all; a flat one makes llama-quantize's plain error-minimizing
    choice (fixtures and studies: no calibration data is implied)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(f32))
    writer = gguf.GGUFWriter(str(out), arch="imatrix")
    writer.add_array("imatrix.datasets", ["flat: every column weighted alike"])
    writer.add_uint32("imatrix.chunk_count", 1)
    writer.add_uint32("imatrix.chunk_size", 1)
    for tensor in reader.tensors:
        if tensor.name.endswith(".weight") and len(tensor.shape) == 2 and "norm" not in tensor.name:
            columns = int(tensor.shape[0])
            writer.add_tensor(f"{tensor.name}.in_sum2", np.ones(columns, dtype=np.float32))
            writer.add_tensor(f"{tensor.name}.counts", np.ones(1, dtype=np.float32))
    _write_out(writer)
    return out


def without_vocabulary(draft_gguf: Path, out_file: Path) -> Path:
    """A copy of a draft GGUF without the target's tokenizer, which the converter copies into
    every draft: ``tokenizer.ggml.model`` "none" and ``<arch>.vocab_size`` the target's, which
    llama.cpp loads as a vocabulary of that many placeholder tokens (no strings, no merges:
    docs/serving.md, "Where the draft's memory goes"). Every other key and every tensor is
    copied byte for byte, through gguf-py (llama.cpp's own GGUF library)."""
    import gguf

    reader = gguf.GGUFReader(str(draft_gguf))
    arch = reader.get_field("general.architecture").contents()
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab_size = reader.get_field(f"{arch}.vocab_size")
    writer = gguf.GGUFWriter(str(out_file), arch=arch)
    for key, f in reader.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture":
            continue
        writer.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    writer.add_tokenizer_model("none")
    if vocab_size is None:
        if tokens is None:
            raise SpecftError(f"{draft_gguf} has neither a vocabulary nor {arch}.vocab_size; the draft cannot go "
                              "without one")
        writer.add_vocab_size(len(tokens.data))
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    _write_out(writer)
    return _check_written(out_file, "gguf-py")
