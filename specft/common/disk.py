"""Disk space: sizes people can read, and a full disk turned into one line.

A write that fills the disk fails deep inside whatever wrote (safetensors, DeepSpeed,
json): each raises its own type with the OS error in its text. ``is_disk_full`` finds
ENOSPC in any of them, so every write site and the CLI's last resort can say what was
kept and how to resume instead of printing a traceback."""

from __future__ import annotations

import errno

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How libraries that wrap the OS error spell it (safetensors: "... (os error 28)").
_DISK_FULL_TEXT = ("no space left on device", "os error 28", "disk quota exceeded", "storagefull")


def format_bytes(n: float) -> str:
    """1234 -> '1.2 kB', 5.6e6 -> '5.6 MB': the unit that fits (decimal, as df -H)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def is_disk_full(err: BaseException | None) -> bool:
    """True when ``err`` or anything in its cause/context chain is a full disk."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(err).lower() for text in _DISK_FULL_TEXT):
            return True
        err = err.__cause__ or err.__context__
    return False


def disk_full_line(where: str, kept: str, resume: str = "rerun the same command to resume") -> str:
    """The one line for a full disk: where it happened, what is kept, what to do."""
    return f"disk full while writing {where}; {kept}; free some space, then {resume}"


def job_disk_full_line(where: str) -> str:
    """The last resort, for a write no site names (metrics, answers, an export): every
    finished shard and checkpoint is renamed into place whole, so they are kept."""
    return disk_full_line(where, "finished checkpoints and cache shards are kept")
