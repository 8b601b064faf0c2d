"""Where llama.cpp is installed (scripts/install_llamacpp.sh) and whether this machine can
run that build: each missing piece is one line with the install command."""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
from pathlib import Path

from specft.common.errors import SpecftError
from specft.common.paths import specft_home

INSTALL_COMMAND = "bash scripts/install_llamacpp.sh"
SPEC_TYPE = "draft-eagle3"  # the llama-server option a build must know to serve specft's drafts
# specft's fixes to llama.cpp, in a source checkout (a wheel ships none, and checks none)
PATCH_DIR = Path(__file__).resolve().parents[2] / "scripts" / "llamacpp_patches"


def prefix() -> Path:
    """$SPECFT_LLAMACPP, else $SPECFT_HOME/llamacpp."""
    value = os.environ.get("SPECFT_LLAMACPP")
    return Path(value).expanduser() if value else specft_home() / "llamacpp"


def _missing(what: str) -> SpecftError:
    return SpecftError(f"llama.cpp: {what}; install it with `{INSTALL_COMMAND}` (or set SPECFT_LLAMACPP to "
                       "its prefix)")


def machine_isa() -> set[str]:
    """The x86 extensions this CPU lists, named as the install script names them."""
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    flags = set(line.split(":", 1)[1].split())
    names = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx_vnni": "AVX_VNNI",
             "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16"}
    isa = {name for flag, name in names.items() if flag in flags}
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"} <= flags:
        isa.add("AVX512")
    return isa


def install_record(root: Path | None = None) -> dict:
    root = root or prefix()
    record = root / "install.json"
    if not record.is_file():
        raise _missing(f"no install at {root}")
    try:
        return json.loads(record.read_text())
    except ValueError as err:
        raise _missing(f"{record} is damaged ({err})") from None


@functools.cache
def check_install(root: Path | None = None) -> Path:
    """The prefix, once its build is known to run here: built for no instruction this CPU
    lacks (an AVX-512 build copied to an AVX2 machine dies with 'invalid opcode'), and
    new enough to serve EAGLE-3 drafts."""
    root = root or prefix()
    record = install_record(root)
    if record.get("machine") not in (None, platform.machine()):
        raise _missing(f"{root} was built for {record['machine']}, this machine is {platform.machine()}")
    lacking = sorted(set(str(record.get("isa", "")).split()) - machine_isa())
    if lacking:
        raise _missing(f"{root} was built for {', '.join(lacking)}, which this CPU lacks; rebuild it here")
    stale = missing_patches(record)
    if stale:
        raise _missing(f"{root} was built without specft's patch {', '.join(stale)} (added since); rebuild it "
                       "(only what the patch touches recompiles)")
    server = root / "bin" / "llama-server"
    if not server.exists():
        raise _missing(f"{server} is missing")
    try:
        help_text = subprocess.run([str(server), "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise _missing(f"{server} does not run ({err})") from None
    if SPEC_TYPE not in help_text:
        raise _missing(f"{server} is too old: it has no --spec-type {SPEC_TYPE}")
    return root


def missing_patches(record: dict, patch_dir: Path = PATCH_DIR) -> list[str]:
    """specft's llama.cpp patches this checkout has and a build's install.json does not list
    (a build from before a patch was added runs the bug it fixes). A record without a patch
    list (made by hand, or before patches were recorded) is not judged."""
    if "patches" not in record or not patch_dir.is_dir():
        return []
    built = {str(entry).split(":", 1)[0] for entry in record["patches"]}
    return sorted(p.name for p in patch_dir.glob("*.patch") if p.name not in built)


def binary(name: str) -> Path:
    path = check_install() / "bin" / name
    if not path.exists():
        raise _missing(f"{path} is missing")
    return path


def converter() -> tuple[Path, dict]:
    """(convert_hf_to_gguf.py, the environment it runs in: the tree's own gguf-py first)."""
    root = check_install()
    script = root / "src" / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise _missing(f"{script} is missing")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src" / "gguf-py"), env.get("PYTHONPATH")]))
    return script, env
