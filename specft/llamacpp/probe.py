"""The target's logits and layer inputs as llama.cpp computes them (specft-llama-probe,
built by the install script against the installed libllama)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specft.common.errors import SpecftError
from specft.llamacpp.install import INSTALL_COMMAND, binary, check_install, install_record

PROBE_SOURCE = Path(__file__).with_name("probe.cpp")


@dataclass
class ProbeResult:
    logits: list[np.ndarray] | None  # per sequence [rows, vocab]
    hidden: list[np.ndarray] | None  # per sequence [rows, len(layers), hidden]
    predicted: list[list[int]]  # per sequence: the tokens the rows predict after
    final: list[np.ndarray] | None = None  # per sequence [rows, hidden]: the final norm's output


def probe_binary() -> Path:
    """The installed probe, once it is known to be built from this specft's probe.cpp (an
    older one lacks options this code passes and would fail on them mid-run)."""
    built = install_record(check_install()).get("probe_sha256")
    if built != hashlib.sha256(PROBE_SOURCE.read_bytes()).hexdigest():
        raise SpecftError(f"llama.cpp: specft-llama-probe in {check_install()} was built from another specft's "
                          f"probe.cpp; rebuild it with `{INSTALL_COMMAND}` (it reuses the llama.cpp build)")
    return binary("specft-llama-probe")


def _split(flat: np.ndarray | None, rows: list[int]) -> list[np.ndarray] | None:
    if flat is None:
        return None
    bounds = np.cumsum([0, *rows])
    return [flat[a:b] for a, b in zip(bounds, bounds[1:])]


def run_probe(gguf: Path, sequences: list[list[int]], *, layers: tuple[int, ...] = (), ubatch: int = 0,
              gen: int = 0, threads: int = 2, flash_attn: str = "auto", logits: bool = True,
              final: bool = False, timeout_s: float = 1800) -> ProbeResult:
    """``ubatch``: tokens per llama_decode (0: the whole sequence, as prompt processing;
    1: one at a time, as decoding). ``gen``: greedy tokens after each sequence instead of
    teacher forcing. ``logits``/``final``: return each row's logits / final-norm output."""
    with tempfile.TemporaryDirectory(prefix="specft-probe-") as tmp:
        tmp = Path(tmp)
        (tmp / "in.txt").write_text("".join(" ".join(map(str, s)) + "\n" for s in sequences))
        args = [str(probe_binary()), str(gguf), str(tmp / "in.txt"), str(tmp), "--ubatch", str(ubatch),
                "--gen", str(gen), "--threads", str(threads), "--fa", flash_attn,
                "--ctx", str(max(len(s) for s in sequences) + gen + 8), "--logits", str(int(logits)),
                "--final", str(int(final))]
        if layers:
            args += ["--layers", ",".join(map(str, layers))]
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise SpecftError(f"specft-llama-probe failed on {gguf} ({done.stderr.strip()[-300:]})")
        return read_results(tmp, gguf, len(sequences), layers, logits, final)


def read_results(out: Path, gguf: Path, sequences: int, layers: tuple[int, ...], logits: bool,
                 final: bool) -> ProbeResult:
    """The probe's files in ``out``, read as untrusted: every array the size its meta.json
    says, or one line."""
    try:
        return _read_results(out, sequences, layers, logits, final)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SpecftError(f"specft-llama-probe exited 0 but its results for {gguf} are missing or damaged "
                          f"({type(err).__name__}: {str(err)[:200]}); rebuild the probe with `{INSTALL_COMMAND}`") \
            from None


def _read_results(out: Path, sequences: int, layers: tuple[int, ...], logits: bool, final: bool) -> ProbeResult:
    meta = json.loads((out / "meta.json").read_text())
    rows, width, vocab = [int(r) for r in meta["rows"]], int(meta["n_embd"]), int(meta["n_vocab"])
    if len(rows) != sequences or min(rows, default=0) < 1:
        raise ValueError(f"meta.json lists rows {rows} for {sequences} sequences")

    def array(name: str, per_row: int) -> np.ndarray:
        data = np.fromfile(out / name, dtype=np.float32)
        if data.size != sum(rows) * per_row:
            raise ValueError(f"{name} holds {data.size} floats, not {sum(rows)} rows of {per_row}")
        return data.reshape(sum(rows), per_row)

    flat_logits = array("logits.f32", vocab) if logits else None
    hidden = array("hidden.f32", len(layers) * width).reshape(-1, len(layers), width) if layers else None
    flat_final = array("final.f32", width) if final else None
    predicted = [[int(t) for t in line.split()] for line in (out / "tokens.txt").read_text().splitlines()]
    return ProbeResult(_split(flat_logits, rows), _split(hidden, rows), predicted, _split(flat_final, rows))
