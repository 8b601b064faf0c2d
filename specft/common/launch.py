"""Launching: one rank in-process; more through `deepspeed --no_local_rank`, each rank
running `python -m specft.commands.worker --config RUN/config.yaml --command CMD`."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from specft.common.errors import ReportedError, SpecftError

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_single_rank_env() -> None:
    """DeepSpeed needs these in-process, or it falls back to MPI discovery. The port is
    always a fresh one: a MASTER_PORT inherited from a process that ran a job before (an
    in-process run sets it in os.environ) may still be held by that job's store."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())


def barrier(world_size: int) -> None:
    """Wait for every rank; a no-op for one rank (no process group needed)."""
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def run_subprocess_rank(config_path: Path, command: str) -> None:
    """One rank in a fresh process: used for multirun jobs, since DeepSpeed keeps
    process-global state that a second in-process job would trip over."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "specft.commands.worker", "--config", str(config_path), "--command", command]
    error_line = None
    with owned_process_group(cmd, env, stderr=subprocess.PIPE, text=True, bufsize=1) as proc:
        for line in proc.stderr:  # passed through as it comes; the rank's own error line kept
            sys.stderr.write(line)
            if line.startswith("error: "):
                error_line = line[len("error: "):].strip()
        proc.wait()
    if proc.returncode != 0:
        if error_line:
            raise ReportedError(error_line)
        raise SpecftError(f"job exited with code {proc.returncode}: {' '.join(cmd)}")


@dataclass
class NodeLaunch:
    """This node's part of a launch without ssh: every node runs the launcher itself."""
    node_rank: int
    master_addr: str
    master_port: int


def launcher_command(config_path: Path, command: str, nproc: int, hostfile: str | None = None,
                     num_nodes: int | None = None, node: NodeLaunch | None = None) -> list[str]:
    # The launcher module of this interpreter's DeepSpeed, not whatever `deepspeed` is on
    # PATH: ranks then run in the same environment (a venv needs no activation).
    port = node.master_port if node else free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--no_local_rank", "--num_gpus", str(nproc),
           "--master_port", str(port)]
    if node:
        hostfile = hostfile or node_hostfile(nproc, num_nodes)
        cmd += ["--no_ssh", "--node_rank", str(node.node_rank), "--master_addr", node.master_addr]
    if hostfile:
        cmd += ["--hostfile", hostfile]
    if num_nodes:
        cmd += ["--num_nodes", str(num_nodes)]
    return cmd + ["--module", "specft.commands.worker", "--config", str(config_path), "--command", command]


def node_hostfile(nproc: int, num_nodes: int) -> str:
    """A hostfile of ``num_nodes`` nodes of ``nproc`` slots, in a node-local temp dir.
    Without ssh DeepSpeed reads only its counts (a node's rank comes from --node_rank),
    so the names are placeholders."""
    path = Path(tempfile.mkdtemp(prefix="specft-nodes-")) / "hostfile"
    path.write_text("".join(f"node-{i} slots={nproc}\n" for i in range(num_nodes)))
    return str(path)


def _die_with_parent() -> None:
    """In the launcher, before exec: the kernel sends it SIGTERM when specft dies, even by
    SIGKILL, and DeepSpeed's launcher passes that on to its ranks (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # no prctl: the process-group cleanup below still runs
        pass


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End whatever is left of the launcher's process group (launcher, ranks): SIGINT
    first (a rank stops as at Ctrl-C), then SIGTERM, then SIGKILL, each given ``grace_s``.
    Returns at once when the group is gone, as after a launch that ended by itself."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the launcher: a zombie still counts as a member of its group
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


@contextmanager
def owned_process_group(cmd: list[str], env: dict, **popen_kwargs):
    """Popen(cmd) in a process group of its own, ended with the block however it ends
    (done, an error, Ctrl-C, or a `kill` of specft, which ends it as Ctrl-C does): no
    launcher or rank outlives the command."""
    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent, **popen_kwargs)
        try:
            yield proc
        finally:
            _stop_group(proc)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def launch_ranks(config_path: Path, command: str, nproc: int, hostfile: str | None = None,
                 num_nodes: int | None = None, node: NodeLaunch | None = None) -> None:
    cmd = launcher_command(config_path, command, nproc, hostfile, num_nodes, node)
    with owned_process_group(cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        proc.wait()
    if proc.returncode == 2:  # a rank refused with its one line (worker.py), printed already
        raise ReportedError(f"{nproc} ranks stopped; see the error line above")
    if proc.returncode != 0:
        raise SpecftError(f"{nproc} ranks exited with code {proc.returncode}: {' '.join(cmd)}")
    sys.stdout.flush()
