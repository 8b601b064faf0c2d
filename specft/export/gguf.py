"""`specft export RUN OUT --layout gguf`: a draft llama-server loads (`-md OUT/draft.gguf
--spec-type draft-eagle3` or `draft-dflash`), written by llama.cpp's own converter from
specft's EAGLE-3 or DFlash export, then read back and checked: architecture, the target
layers it taps, the target width and vocabulary, the draft vocabulary map, DFlash's block.

What llama.cpp cannot take is refused in one line rather than converted into a file that
would load and compute something else: each draft folder that llama.cpp can take registers
its refusals beside its layouts (drafts/eagle3/export.py, drafts/dflash/export.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from specft.common.errors import SpecftError
from specft.common.lock import sibling_lock
from specft.drafts.layouts import LLAMACPP_DRAFTS
from specft.export.files import check_out_dir, draft_meta
from specft.export.safetensors import export_draft

log = logging.getLogger(__name__)

DRAFT_FILE = "draft.gguf"

# the draft's weight type -> how it is written: the converter's --outtype, then llama-quantize's
# type when the converter has none. Q8_0 and Q4_0 blocks of 32 divide every EAGLE-3 and
# DFlash width; the 256-wide K- and i-quants would not (576 = 2.25 x 256), so llama-quantize
# would silently fall back per tensor, and they are not offered.
GGUF_TYPES = {"f32": ("f32", None), "f16": ("f16", None), "bf16": ("bf16", None), "q8_0": ("q8_0", None),
              "q4_0": ("f16", "Q4_0")}
# what the draft GGUF carries of the target's tokenizer: target (the converter's copy, which any
# llama.cpp reads) or none (a placeholder vocabulary of the target's size: ~11 MB less server
# memory for SmolLM2's 49,152 tokens; llama-server -v needs specft's llama.cpp patch 0002)
GGUF_VOCABULARIES = ("target", "none")


def export_gguf(checkpoint: str | Path, out_dir: str | Path, target: str | Path | None = None,
                overwrite: bool = False, gguf_type: str = "f16", vocabulary: str = "target") -> Path:
    from specft.eval.drafts import load_draft, resolve_checkpoint
    from specft.llamacpp.convert import hf_to_gguf, quantize, without_vocabulary

    if gguf_type not in GGUF_TYPES:
        raise SpecftError(f"--gguf-type: llama.cpp loads a specft draft written as {', '.join(GGUF_TYPES)}; got "
                          f"{gguf_type!r} (the 256-wide K- and i-quants do not divide the draft's widths)")
    if vocabulary not in GGUF_VOCABULARIES:
        raise SpecftError(f"--gguf-vocab: one of {', '.join(GGUF_VOCABULARIES)}; got {vocabulary!r}")
    folder = resolve_checkpoint(checkpoint, "checkpoint")
    out = check_out_dir(Path(out_dir).expanduser(), overwrite)
    _, draft_config = load_draft(folder, field="checkpoint")
    meta = draft_meta(folder, draft_config)
    arch = meta.get("architecture", "eagle3")
    if arch not in LLAMACPP_DRAFTS:
        raise SpecftError(f"--layout gguf: llama.cpp's converter takes no specft {arch} draft yet; "
                          f"convertible: {', '.join(LLAMACPP_DRAFTS.names)}")
    kind = LLAMACPP_DRAFTS.get(arch)
    reason = kind.refusal(meta)
    if reason:
        raise SpecftError(f"--layout gguf: {reason}")
    if vocabulary == "none" and not kind.vocabulary_optional:
        raise SpecftError(f"--gguf-vocab none: llama.cpp's {kind.spec_type} reads the draft's own vocabulary; "
                          "export this draft with --gguf-vocab target")
    with tempfile.TemporaryDirectory(prefix="specft-gguf-") as tmp:
        tmp = Path(tmp)
        hf = export_draft(folder, tmp / "hf", layout=kind.hf_layout, quant="none", dtype="float32")
        target_dir, pre_tokenizer = _target_dir(
            target or _run_target(folder) or (meta.get("verifier") or {}).get("name_or_path"), tmp / "target")
        outtype, requantize = GGUF_TYPES[gguf_type]
        converted = hf_to_gguf(hf, tmp / DRAFT_FILE, outtype=outtype, target_model_dir=target_dir,
                               pre_tokenizer=pre_tokenizer)
        if requantize:
            converted = quantize(converted, tmp / f"{requantize}-{DRAFT_FILE}", requantize)
        if vocabulary == "none":
            converted = without_vocabulary(converted, tmp / f"novocab-{DRAFT_FILE}")
        facts = check_draft_gguf(converted, meta)
        with sibling_lock(out, "out_dir", "specft export"):
            check_out_dir(out, overwrite)
            out.mkdir(parents=True, exist_ok=True)
            staged = out / f".{DRAFT_FILE}.tmp"
            shutil.copyfile(converted, staged)
            os.chmod(staged, 0o644)
            os.replace(staged, out / DRAFT_FILE)
            (out / "serving.json").write_text(json.dumps({"spec_type": kind.spec_type, "gguf_type": gguf_type,
                                                          "gguf_vocab": vocabulary, **facts}, indent=2))
    log.info("export: gguf draft (%s) -> %s", kind.spec_type, out / DRAFT_FILE)
    return out


def _run_target(folder: Path) -> str | None:
    """The run's model.path (a .gguf the draft was trained against), from its config.yaml."""
    import yaml

    config = folder / "config.yaml"
    run = yaml.safe_load(config.read_text()) if config.is_file() else {}
    path = (run.get("model") or {}).get("path")
    return path if path and str(path).endswith(".gguf") else None


def _target_dir(target: str | Path | None, scratch: Path) -> tuple[Path, str | None]:
    """A directory with the target's config.json and tokenizer: the one given, the GGUF or
    checkpoint the draft was trained against (a GGUF's header written out as one); and a
    GGUF's pre-tokenizer name, which the draft must carry too."""
    where = Path(target or "").expanduser()
    if where.suffix == ".gguf" and where.is_file():
        return _hf_dir_from_gguf(where, scratch), gguf_facts(where)["pre_tokenizer"]
    if (where / "config.json").is_file():
        return where, None
    raise SpecftError(f"--target: the draft's target {str(where) or '(unknown)'} is not a local checkpoint "
                      "directory or .gguf file; give --target DIR_OR_GGUF (its vocabulary goes into the draft)")


def _hf_dir_from_gguf(gguf_file: Path, scratch: Path) -> Path:
    from transformers import AutoTokenizer

    from specft.quantized_checkpoints.gguf_family import hf_config

    scratch.mkdir(parents=True, exist_ok=True)
    hf_config(gguf_file).save_pretrained(scratch)
    AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(scratch)
    return scratch


def draft_architectures() -> set[str]:
    """The general.architecture values of the draft GGUFs specft writes (LLAMACPP_DRAFTS)."""
    return {LLAMACPP_DRAFTS.get(name).architecture for name in LLAMACPP_DRAFTS.names}


def gguf_facts(path: Path) -> dict:
    """What llama.cpp reads of a draft or target GGUF: architecture, width, vocabulary,
    and a draft's target layers, target width and draft vocabulary."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key):
        f = reader.get_field(key)
        if f is None:
            return None
        values = [f.parts[i] for i in f.data]
        decoded = [bytes(v).decode() if v.dtype == np.uint8 else v.tolist() for v in values]
        flat = [x[0] if isinstance(x, list) and len(x) == 1 else x for x in decoded]
        return flat if len(flat) > 1 else flat[0]

    arch = field("general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    tokens = reader.get_field("tokenizer.ggml.tokens")
    # a draft without a vocabulary of its own declares the size of its placeholder one
    facts = {"architecture": arch, "hidden_size": field(f"{arch}.embedding_length"),
             "num_layers": field(f"{arch}.block_count"),
             "vocab_size": len(tokens.data) if tokens is not None else field(f"{arch}.vocab_size"),
             "pre_tokenizer": field("tokenizer.ggml.pre")}
    if arch in draft_architectures():
        layers = field(f"{arch}.target_layers") or field(f"{arch}.extract_layers")
        facts["target_layers"] = [int(x) for x in (layers if isinstance(layers, list) else [layers])]
    if arch == "eagle3":
        facts.update(target_hidden_size=field(f"{arch}.target_hidden_size"),
                     draft_vocab_size=int(tensors["d2t"].shape[0]) if "d2t" in tensors else facts["vocab_size"])
    if arch == "dflash":  # fc reads the target layers side by side; the head covers the vocabulary
        facts.update(target_hidden_size=int(tensors["fc.weight"].shape[0]) // len(facts["target_layers"]),
                     draft_vocab_size=int(tensors["output.weight"].shape[1]) if "output.weight" in tensors
                     else facts["vocab_size"],
                     block_size=field(f"{arch}.block_size"))
    return facts


def check_draft_gguf(path: Path, meta: dict) -> dict:
    """The converted file read back: it must tap the layers the draft was trained on and
    keep its width and vocabulary map, or nothing is written."""
    from specft.drafts.layouts import vllm_aux_ids

    facts = gguf_facts(path)
    arch = LLAMACPP_DRAFTS.get(meta.get("architecture", "eagle3")).architecture
    expected = {"architecture": arch, "target_layers": vllm_aux_ids(meta),
                "target_hidden_size": meta.get("target_hidden_size", meta["hidden_size"]),
                "draft_vocab_size": meta.get("draft_vocab_size") or meta["target_vocab_size"]}
    if arch == "dflash":  # the bonus token and k mask slots
        expected["block_size"] = meta["max_draft_tokens"] + 1
    for key, want in expected.items():
        if facts.get(key) != want:
            raise SpecftError(f"--layout gguf: llama.cpp's converter wrote {key}={facts.get(key)}, the draft needs "
                              f"{want}; nothing was written")
    return facts


def check_pair(target_gguf: Path, draft_gguf: Path) -> None:
    """A draft GGUF fits a target GGUF: the same vocabulary and the width it was trained on."""
    target, draft = gguf_facts(target_gguf), gguf_facts(draft_gguf)
    if draft.get("architecture") not in draft_architectures():
        return
    if draft.get("target_hidden_size") != target["hidden_size"]:
        raise SpecftError(f"draft {draft_gguf.name} was exported for a target of width {draft['target_hidden_size']}, "
                          f"{target_gguf.name} has {target['hidden_size']}")
    if draft.get("vocab_size") != target["vocab_size"]:
        raise SpecftError(f"draft {draft_gguf.name} carries a vocabulary of {draft['vocab_size']} tokens, "
                          f"{target_gguf.name} has {target['vocab_size']}")
    if max(draft["target_layers"]) > (target.get("num_layers") or 0):
        raise SpecftError(f"draft {draft_gguf.name} taps layer {max(draft['target_layers'])}, beyond the target")
