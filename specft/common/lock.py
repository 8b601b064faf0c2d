"""One writer per directory: a lock file naming its holder (pid, host, command).

Two `specft train` in one run dir would append to the same metrics file and overwrite
each other's checkpoints; two builds of one cache would write the same shards. The lock
is a file holding who took it, and an exclusive ``flock`` on it for as long as the
holder runs: the kernel drops the flock when the holder's process ends, however it
ends, so a lock file left by a run killed with SIGKILL is stale by construction and is
taken over with a warning naming the dead holder; a live holder is refused in one line
naming it, or (``acquire(wait=True)``, a cache under ``cache.wait=true``) waited for.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from specft.common.errors import SpecftError

log = logging.getLogger(__name__)

LOCK_NAME = ".specft.lock"


def _describe(holder: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("time", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')} ({holder.get('command')}, since {when})"


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        holder = json.loads(os.read(fd, 1 << 16) or b"{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


class DirLock:
    """``with DirLock(path, field):`` holds the lock file ``path`` for this process.
    ``field`` names the locked directory in the refusal line (run_dir, cache, out_dir)."""

    def __init__(self, lock_path: Path, field: str, command: str | None = None):
        self.path, self.field = Path(lock_path), field
        self.command = command or "specft " + " ".join(sys.argv[1:2])
        self.fd: int | None = None

    def _open_locked(self, wait: bool) -> int | None:
        """An fd of the file at ``path`` with our flock on it; None when the file was
        replaced under us (retry). A live holder: the refusal, or with ``wait`` a line
        naming it and a blocking wait until it ends."""
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            named = _describe(holder) if holder else "another specft process"
            if not wait:
                os.close(fd)
                raise SpecftError(f"{self.field}: {self.path.parent} is in use by {named}; "
                                  "wait for it to finish, or use another directory") from None
            log.info("%s: %s is in use by %s; waiting for it to finish", self.field, self.path.parent, named)
            fcntl.flock(fd, fcntl.LOCK_EX)  # the kernel hands it over when the holder ends
        try:  # the holder before us may have removed the file as we opened it: retry then
            same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            return None
        return fd

    def acquire(self, wait: bool = False) -> DirLock:
        """Take the lock; a live holder is refused, or with ``wait`` waited for."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            fd = self._open_locked(wait)
            if fd is not None:
                break
        else:
            raise SpecftError(f"{self.field}: cannot take the lock {self.path}; other processes keep taking it")
        stale = _read_holder(fd)
        if stale:
            log.warning("%s: took over the lock %s left by %s, which is no longer running",
                        self.field, self.path, _describe(stale))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command, "time": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # before the flock goes: no one sees our file free
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def dir_lock(directory: str | Path, field: str, command: str | None = None) -> DirLock:
    """The lock of a directory specft writes into (a run dir, a cache dir): a file inside."""
    return DirLock(Path(directory) / LOCK_NAME, field, command)


def sibling_lock(directory: str | Path, field: str, command: str | None = None) -> DirLock:
    """The lock of a directory that must hold only what its writer puts there (an
    export): a hidden file beside it."""
    d = Path(directory)
    return DirLock(d.parent / f".{d.name}{LOCK_NAME}", field, command)
