"""Where a rank's process group starts: the ranks meet at node 0's store
(MASTER_ADDR:MASTER_PORT, from the launcher) within trainer.rendezvous_timeout_s.

torch's own env:// rendezvous waits as long as the process group's collective timeout
(DeepSpeed's 10 minutes) and then ends in c10d warnings or C++ stack frames. specft
meets at the store itself, bounded by its own timeout, and turns a failure into one line
naming the address; the process group then starts on that store with the usual
collective timeout, which long stage-1 work between barriers needs."""

from __future__ import annotations

import os
from datetime import timedelta

from specft.errors import SpecftError


def rendezvous_line(addr: str, port: int, timeout_s: float, rank: int, world: int, why: str) -> str:
    who = (f"rank 0 (node 0) waited for the other {world - 1} rank(s) at {addr}:{port}" if rank == 0 else
           f"rank {rank} could not reach node 0 at {addr}:{port}")
    return (f"rendezvous: {who} for {timeout_s:g} s (trainer.rendezvous_timeout_s) ({why}); check that every node "
            "runs the same command with the same trainer.num_nodes and master_port, that trainer.master_addr is "
            "node 0's address as this node sees it, and that the port is open between the nodes")


def meet(timeout_s: float):
    """The store every rank of this launch shares (rank 0 serves it), or one line."""
    from torch.distributed import TCPStore

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        return TCPStore(addr, port, world, rank == 0, timedelta(seconds=timeout_s), wait_for_workers=True)
    except (RuntimeError, OSError, ValueError) as err:  # c10d's store errors, a name that does not resolve
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SpecftError(rendezvous_line(addr, port, timeout_s, rank, world, why[:200])) from None
