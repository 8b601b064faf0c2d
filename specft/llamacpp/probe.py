"""The target's logits and layer inputs as llama.cpp computes them (specft-llama-probe,
built by the install script against the installed libllama)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specft.errors import SpecftError
from specft.llamacpp.install import binary


@dataclass
class ProbeResult:
    logits: list[np.ndarray]  # per sequence [rows, vocab]
    hidden: list[np.ndarray] | None  # per sequence [rows, len(layers), hidden]
    predicted: list[list[int]]  # per sequence: the tokens the rows predict after


def run_probe(gguf: Path, sequences: list[list[int]], *, layers: tuple[int, ...] = (), ubatch: int = 0,
              gen: int = 0, threads: int = 2, flash_attn: str = "auto", timeout_s: float = 1800) -> ProbeResult:
    """``ubatch``: tokens per llama_decode (0: the whole sequence, as prompt processing;
    1: one at a time, as decoding). ``gen``: greedy tokens after each sequence instead of
    teacher forcing."""
    with tempfile.TemporaryDirectory(prefix="specft-probe-") as tmp:
        tmp = Path(tmp)
        (tmp / "in.txt").write_text("".join(" ".join(map(str, s)) + "\n" for s in sequences))
        args = [str(binary("specft-llama-probe")), str(gguf), str(tmp / "in.txt"), str(tmp), "--ubatch", str(ubatch),
                "--gen", str(gen), "--threads", str(threads), "--fa", flash_attn,
                "--ctx", str(max(len(s) for s in sequences) + gen + 8)]
        if layers:
            args += ["--layers", ",".join(map(str, layers))]
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise SpecftError(f"specft-llama-probe failed on {gguf} ({done.stderr.strip()[-300:]})")
        meta = json.loads((tmp / "meta.json").read_text())
        logits = np.fromfile(tmp / "logits.f32", dtype=np.float32).reshape(-1, meta["n_vocab"])
        hidden = (np.fromfile(tmp / "hidden.f32", dtype=np.float32).reshape(-1, len(layers), meta["n_embd"])
                  if layers else None)
        predicted = [[int(t) for t in line.split()] for line in (tmp / "tokens.txt").read_text().splitlines()]
    bounds = np.cumsum([0, *meta["rows"]])
    return ProbeResult([logits[a:b] for a, b in zip(bounds, bounds[1:])],
                       [hidden[a:b] for a, b in zip(bounds, bounds[1:])] if hidden is not None else None,
                       predicted)
