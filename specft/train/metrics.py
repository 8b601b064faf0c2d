"""Metric sinks: metrics.jsonl always; wandb when logger=wandb (offline without a key)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from specft.config import LoggerConfig


def _record(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


class JsonlSink:
    def __init__(self, path: Path, resume_step: int):
        self.path = path
        # Drop lines logged after the checkpoint we resume from: the resumed run logs
        # those steps again.
        # A line cut short by a kill (or otherwise unreadable) is dropped, not fatal.
        if path.exists():
            kept = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines()
                    if (rec := _record(ln)) is not None and rec.get("step", 0) <= resume_step]
            path.write_text("".join(ln + "\n" for ln in kept))
        self._f = open(path, "a")

    def log(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class WandbSink:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict):
        import wandb

        mode = cfg.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self._run = wandb.init(project=cfg.project, dir=str(run_dir), config=config, mode=mode,
                               name=run_dir.name, id=_stable_id(run_dir), resume="allow")

    def log(self, record: dict) -> None:
        split = record.get("split", "train")
        values = {f"{split}/{k}": v for k, v in record.items() if k not in ("step", "split")}
        self._run.log(values, step=record["step"])

    def close(self) -> None:
        self._run.finish()


def _stable_id(run_dir: Path) -> str:
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]


class MetricsLogger:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict, resume_step: int):
        self.sinks = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
        if cfg.name == "wandb":
            self.sinks.append(WandbSink(cfg, run_dir, config))

    def log(self, record: dict) -> None:
        for s in self.sinks:
            s.log(record)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
