"""Where a rank's process group starts: the ranks meet at node 0's store
(MASTER_ADDR:MASTER_PORT, from the launcher) within trainer.rendezvous_timeout_s.

torch's own env:// rendezvous waits as long as the process group's collective timeout
(DeepSpeed's 10 minutes) and then ends in c10d warnings or C++ stack frames. specft
meets at the store itself, bounded by its own timeout, and turns a failure into one line
naming the address; the process group then starts on that store with the usual
collective timeout, which long stage-1 work between barriers needs."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from datetime import timedelta
from pathlib import Path

from specft.common.errors import SpecftError, first_line


def rendezvous_line(addr: str, port: int, timeout_s: float, rank: int, world: int, why: str) -> str:
    who = (f"rank 0 (node 0) waited for the other {world - 1} rank(s) at {addr}:{port}" if rank == 0 else
           f"rank {rank} could not reach node 0 at {addr}:{port}")
    return (f"rendezvous: {who} for {timeout_s:g} s (trainer.rendezvous_timeout_s) ({why}); check that every node "
            "runs the same command with the same trainer.num_nodes and master_port, that trainer.master_addr is "
            "node 0's address as this node sees it, and that the port is open between the nodes")


def meet(timeout_s: float, log_path: Path | None = None):
    """The store every rank of this launch shares (rank 0 serves it), or one line within
    the timeout whatever answers at the address: nothing (a closed port, an address that
    drops packets), another service (an HTTP server reads c10d's handshake and waits for
    more, which TCPStore's own timeout does not bound), or garbage (c10d retries, printing
    C++ stack frames each time). Those frames go to ``log_path`` (default: a file of this
    rank's in the temp folder, named in the line), not to the terminal."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    log_path = log_path or Path(tempfile.gettempdir()) / f"specft-rendezvous-{port}-rank{rank}.log"
    outcome: dict = {}

    def connect():
        from torch.distributed import TCPStore

        try:
            outcome["store"] = TCPStore(addr, port, world, rank == 0, timedelta(seconds=timeout_s),
                                        wait_for_workers=True)
        except (RuntimeError, OSError, ValueError) as err:  # c10d's store errors, a name that does not resolve
            outcome["error"] = err

    # the store is made on a daemon thread: one stuck on a silent peer must not keep the
    # process alive after the refusal
    attempt = threading.Thread(target=connect, name="rendezvous", daemon=True)
    with _stderr_to(log_path):
        attempt.start()
        attempt.join(timeout_s + GRACE_S)
    if "store" in outcome:
        return outcome["store"]
    err = outcome.get("error")
    if err is None:
        why = f"no store answered at {addr}:{port}: another service may hold the port"
    else:
        why = first_line(err, default=type(err).__name__)
    raise SpecftError(rendezvous_line(addr, port, timeout_s, rank, world, why) + f"; c10d's messages: {log_path}")


# beyond trainer.rendezvous_timeout_s, the time c10d's own timeout may take to fire
GRACE_S = 5.0


@contextlib.contextmanager
def _stderr_to(log_path: Path):
    """File descriptor 2 (where c10d's C++ logging writes) sent to ``log_path`` meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
