"""Checks that run before a command writes anything.

A refused command must change nothing: every input a job reads is checked here, from the
composed config, before Hydra creates the run directory and before config.yaml is
written. Each check runs the code the job itself will run (the data is loaded as stage 1
loads it), so what passes here does not fail later for the same reason.
"""

from __future__ import annotations

import logging
from pathlib import Path

from specft.common.errors import SpecftError
from specft.common.paths import models_dir, require_writable_dir, specft_home
from specft.config import ModelConfig, RootConfig
from specft.quantized_checkpoints.gguf_family import is_gguf_file

log = logging.getLogger(__name__)

# Model sources that read model.path (target/loader.py MODEL_SOURCES); the others build
# or convert their model under SPECFT_HOME and would ignore it.
SOURCES_READING_PATH = ("hf", "gguf")


def check_model_path(model: ModelConfig) -> None:
    """model.path names a directory that exists when it is a local path, and is given
    only to models that read it."""
    if model.source not in SOURCES_READING_PATH:
        if model.path:
            raise SpecftError(f"model.path: model={model.name} is built by specft (source={model.source}) and "
                              "reads no model.path; for a local checkpoint use a model config with source=hf "
                              "(e.g. model=qwen3_8b model.path=DIR)")
        return
    if model.source == "gguf" and model.gguf_file and Path(model.gguf_file).is_absolute():
        if not Path(model.gguf_file).is_file():
            raise SpecftError(f"model.gguf_file: no such file: {model.gguf_file}")
        return
    if not model.path:
        return  # validate.py refuses an hf model without a path; gguf may name an absolute file
    path = Path(model.path).expanduser()
    if path.exists():
        if model.source == "hf" and is_gguf_file(path):
            return  # run as llama.cpp serves it (quant=checkpoint)
        if not path.is_dir():
            raise SpecftError(f"model.path: {model.path} is a file; give the checkpoint's directory (or a .gguf file)")
        if model.source == "hf" and not (path / "config.json").is_file():
            raise SpecftError(f"model.path: {model.path} holds no config.json; give a Hugging Face checkpoint "
                              "directory")
        return
    if _looks_local(model.path):
        raise SpecftError(f"model.path: no such {'file' if str(model.path).endswith('.gguf') else 'directory'}: "
                          f"{model.path}")


def check_checkpoint_quant(root: RootConfig) -> None:
    """quant=checkpoint runs a local quantized checkpoint; an emulated format on a
    checkpoint that is already quantized would quantize it twice."""
    from specft.quantized_checkpoints import check_unquantized, detect_family, open_checkpoint
    from specft.target_model.loader import check_checkpoint_placement

    model, quant = root.model, root.quant
    local = model.source == "hf" and model.path and (Path(model.path).expanduser().is_dir()
                                                     or is_gguf_file(model.path))
    if quant.from_checkpoint:
        if not local:
            raise SpecftError(f"quant=checkpoint: runs the quantized checkpoint in model.path; give a local "
                              f"checkpoint directory or .gguf file (model={model.name} has source={model.source}, "
                              f"path={model.path})")
        checkpoint = open_checkpoint(Path(model.path).expanduser())
        if checkpoint is None:
            check_unquantized(Path(model.path).expanduser())  # an unknown quant_method, or a config that lost it
            raise SpecftError(f"quant=checkpoint: {model.path} is not a quantized checkpoint (its config.json has "
                              "no quantization_config); name a format to emulate instead, e.g. quant=fp8 (bf16: none)")
        check_checkpoint_placement(checkpoint.family, root.cache.sharding, model.checkpoint_weights == "packed")
        return
    family = detect_family(Path(model.path).expanduser()) if local else None
    if family is not None:
        raise SpecftError(f"quant={quant.name}: {model.path} is already quantized ({family.name}); quantizing it "
                          "again would emulate a model nobody serves; use quant=checkpoint to run it as it is served")
    if local:
        check_unquantized(Path(model.path).expanduser())


def _looks_local(value: str) -> bool:
    """A hub id is 'org/name': anything else (absolute, ./, ~, deeper paths) is a path."""
    return value.startswith(("/", ".", "~")) or value.count("/") != 1


# Data configs this process has loaded already: the CLI checks every job before Hydra
# runs, and the job checks again once Hydra resolved it; a large file loads once.
_DATA_LOADED: set[str] = set()


def check_data(root: RootConfig, command: str) -> None:
    """The job's local data files load and yield conversations (missing, empty, not
    JSON, no usable record: one line naming the file). Sources that download are left
    to the job."""
    import json

    from specft.data import check_data_files, load_conversations, mix_members
    from specft.data.sources import DATA_SOURCES
    from specft.eval.prompts import eval_prompt_data
    from specft.provenance.keys import cache_key

    data = root.data
    check_data_files(data)
    members = mix_members(data) if data.name == "mix" else [data]
    if not all(getattr(DATA_SOURCES.get(m.name, "data.name"), "reads_file", False) or m.name == "synthetic"
               for m in members):
        return
    data = eval_prompt_data(data, root.eval.num_prompts) if command == "eval" else data
    key = json.dumps(cache_key(data), sort_keys=True)
    if key not in _DATA_LOADED:
        load_conversations(data)
        _DATA_LOADED.add(key)  # only once it loaded: a refused file is checked again


def check_writable_places(root: RootConfig, command: str) -> None:
    from specft.target_model.loader import local_build_dir

    if command == "eval":
        require_writable_dir(root.eval.out_dir or Path(root.run_dir) / "eval", "eval.out_dir")
    else:
        require_writable_dir(root.run_dir, "run_dir (runs/ under the working directory by default)")
        require_writable_dir(root.cache.dir or root.cache.root, "cache.dir" if root.cache.dir else "cache.root")
    build_dir = local_build_dir(root.model)
    if build_dir is not None and not build_dir.is_dir():
        require_writable_dir(models_dir(), "SPECFT_HOME (where specft builds local models)")


def warn_emulated_bf16(precision: str) -> bool:
    """A bf16 draft on a device that only emulates bf16 (a CPU without AVX512-BF16 or AMX)
    trains several times slower than in float32: warn, since it still trains correctly.
    True when it warned."""
    from specft.device import native_bf16

    if precision not in ("bf16", "amp_bf16") or native_bf16():
        return False
    log.warning("trainer.precision=%s: this device has no native bfloat16 (on CPU: AVX512-BF16 or AMX), "
                "so bf16 is emulated and slower than trainer.precision=fp32", precision)
    return True


def check_before_writing(root: RootConfig, cfg_dict: dict, command: str) -> None:
    """Every check a job's inputs must pass, cheapest first; raises SpecftError."""
    from specft.common.rundir import check_resume

    specft_home()
    check_model_path(root.model)
    check_checkpoint_quant(root)
    check_writable_places(root, command)
    check_data(root, command)
    if command != "eval":
        from specft.engines import engine_for

        engine_for("features", root.cache.engine).check_ready(root)  # e.g. llama.cpp not installed
    if command == "train" and root.trainer.unrotate is not None:
        from specft.target_model.rotation_source import served_rotation

        served_rotation(root)  # an unknown or bad R1, before stage 1 runs
    if command != "eval":
        check_resume(Path(root.run_dir), cfg_dict)
    if command == "train":
        warn_emulated_bf16(root.trainer.precision)
    checkpoints = Path(root.run_dir) / "checkpoints"
    if command == "train" and root.trainer.resume and checkpoints.is_dir():
        from specft.train.checkpoint import latest_tag

        latest_tag(checkpoints)  # a pointer to a checkpoint that is gone: refused before any write
