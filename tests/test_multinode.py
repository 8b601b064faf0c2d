"""Several nodes without ssh: one `specft` per node with its trainer.node_rank, here two
"nodes" on this machine (gloo, one rank each) against two ranks on one node."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from specft.common.launch import free_port

from conftest import run_cli

COMMON = ["train", "model=tiny_qwen3", "quant=mxfp4", "data.num_samples=24", "trainer.max_steps=4",
          "trainer.micro_batch_size=2"]


def _two_nodes(args: list[str], cwd: Path) -> list[str]:
    """Node 0 and node 1 started at once, as a user starts them on two hosts."""
    nodes = [*args, "trainer.num_nodes=2", "trainer.master_addr=127.0.0.1", f"trainer.master_port={free_port()}"]
    procs = [subprocess.Popen([sys.executable, "-m", "specft.cli", *nodes, f"trainer.node_rank={r}"], cwd=cwd,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=3600) for p in procs]
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {r} exited {p.returncode}\n{err[-3000:]}"
    return [err for _, err in outs]


def _tensors(paths: list[Path]) -> list[dict]:
    return [load_file(str(p)) for p in paths]


def _equal(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all((x[k] == y[k]).all() for k in x)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("features", ["cache", "online"])
def test_two_nodes_equal_two_ranks_on_one_node(tmp_path, features):
    # several shards per rank in a cache; online writes none (and refuses the option)
    args = [*COMMON, f"trainer.features={features}", *(["cache.samples_per_shard=5"] if features == "cache" else [])]
    run_cli([*args, "trainer.nproc=2", f"cache.root={tmp_path / 'one_cache'}", f"run_dir={tmp_path / 'one'}"],
            cwd=tmp_path)
    errs = _two_nodes([*args, f"cache.root={tmp_path / 'nodes_cache'}", f"run_dir={tmp_path / 'nodes'}"], tmp_path)
    assert "node 1 of 2, ranks join node 0 at 127.0.0.1" in errs[1]
    final = "checkpoints/final/draft.safetensors"
    assert _equal(_tensors([tmp_path / "nodes" / final]), _tensors([tmp_path / "one" / final]))
    one_shards = sorted((tmp_path / "one_cache").glob("*/shard-*"))
    node_shards = sorted((tmp_path / "nodes_cache").glob("*/shard-*"))
    if features == "online":
        assert not one_shards and not node_shards
    else:  # stage 1: each node's rank wrote its slice, as each rank of one node does
        assert [p.name for p in node_shards] == [p.name for p in one_shards]
        assert {p.name[:10] for p in node_shards} == {"shard-r000", "shard-r001"}
        assert _equal(_tensors(node_shards), _tensors(one_shards))


@pytest.mark.parametrize("override, message", [
    ("trainer.node_rank=1", "trainer.node_rank: needs trainer.num_nodes"),
    ("trainer.node_rank=2 trainer.num_nodes=2", "trainer.node_rank: must be in 0..1"),
    ("trainer.node_rank=0 trainer.num_nodes=2", "trainer.master_addr: trainer.node_rank needs node 0's address"),
    # was ignored: one node trained alone, exit 0
    ("trainer.num_nodes=2", "trainer.num_nodes=2: say how the nodes start"),
    # was 10 minutes of c10d warnings at the rendezvous
    ("trainer.node_rank=1 trainer.num_nodes=2 trainer.master_addr=no-such-node.invalid",
     "trainer.master_addr: no-such-node.invalid does not resolve on this node"),
    ("trainer.rendezvous_timeout_s=0", "trainer.rendezvous_timeout_s: must be > 0"),
])
def test_node_launch_refusals(tmp_path, override, message):
    proc = run_cli(["train", "model=tiny_qwen3", *override.split()], cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr
    assert list(tmp_path.iterdir()) == []


def _node(rank: int, port: int, timeout_s: float, cwd: Path) -> subprocess.Popen:
    args = [*COMMON, "trainer.num_nodes=2", "trainer.master_addr=127.0.0.1", f"trainer.master_port={port}",
            f"trainer.node_rank={rank}", f"trainer.rendezvous_timeout_s={timeout_s}", f"run_dir={cwd / 'run'}"]
    # SIGINT as a terminal gives it: a suite started as a background job (make test &) hands
    # its children SIGINT ignored, and the killed-launch test's Ctrl-C would then do nothing
    return subprocess.Popen([sys.executable, "-m", "specft.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("rank, says", [
    (1, "rank 1 could not reach node 0 at 127.0.0.1:{port} for 2 s (trainer.rendezvous_timeout_s)"),
    (0, "rank 0 (node 0) waited for the other 1 rank(s) at 127.0.0.1:{port} for 2 s"),
])
def test_a_node_alone_stops_at_the_rendezvous_timeout_with_one_line(tmp_path, rank, says):
    """Was 10 minutes of c10d warnings or C++ stack frames: now one line naming the
    address, after trainer.rendezvous_timeout_s, from either side of the rendezvous."""
    port = free_port()
    proc = _node(rank, port, 2, tmp_path)
    _, err = proc.communicate(timeout=3600)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and errors and errors[0].startswith(f"error: rendezvous: {says.format(port=port)}"), err
    assert "Traceback" not in err



def _http_service(sock):
    """Another service on the master port: reads a request, waits for the rest."""
    while True:
        conn, _ = sock.accept()
        conn.recv(1024)  # c10d's handshake, read as the start of a request; no answer


def _garbage_service(sock):
    """A master that answers garbage to whatever it is sent."""
    while True:
        conn, _ = sock.accept()
        try:
            conn.recv(1024)
            conn.sendall(b"\xde\xad\xbe\xef" * 64)
        finally:
            conn.close()


@pytest.mark.parametrize("service, why", [
    (_http_service, "no store answered at 127.0.0.1:{port}: another service may hold the port"),
    (_garbage_service, "Ping failed"),
])
def test_a_port_held_by_another_service_is_one_line_without_cpp_frames(tmp_path, service, why):
    """Was a silent hang past trainer.rendezvous_timeout_s (an HTTP server on the port), or
    a hundred lines of C++ stack frames before any specft line (garbage answers, #63):
    one line naming the cause, c10d's frames in the log file it names, nothing left running."""
    import socket
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    threading.Thread(target=service, args=(sock,), daemon=True).start()
    proc = _node(1, port, 2, tmp_path)
    _, err = proc.communicate(timeout=3600)  # a hang bound: the event is the node's exit
    sock.close()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, err
    assert errors[0].startswith(f"error: rendezvous: rank 1 could not reach node 0 at 127.0.0.1:{port} for 2 s")
    assert why.format(port=port) in errors[0] and "c10d's messages: " in errors[0]
    assert "frame #" not in err and "TCPStore.cpp" not in err and "Traceback" not in err
    assert not [p for p in psutil.process_iter() if f"trainer.master_port={port}" in " ".join(_cmdline(p))]

def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:  # a short-lived helper the launcher ran has exited (a zombie, or gone)
        return []


def _ranks_started(proc: subprocess.Popen) -> list[psutil.Process]:
    """specft's launcher and rank processes, once a rank is up."""
    deadline = time.monotonic() + 1800  # a hang bound: the event is a rank appearing, or the launch dying
    while time.monotonic() < deadline:
        tree = psutil.Process(proc.pid).children(recursive=True)
        if any("specft.commands.worker" in " ".join(_cmdline(p)) for p in tree):
            return tree
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.1)
    raise AssertionError("no rank process started")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_no_process_outlives_a_killed_launch(tmp_path, sig):
    """A node waiting at the rendezvous, killed by the user: its launcher and rank go with
    it (the launcher kept running after a kill before), by SIGKILL too."""
    proc = _node(1, free_port(), 600, tmp_path)
    tree = _ranks_started(proc)
    proc.send_signal(sig)
    proc.communicate(timeout=1800)  # hang bounds: the events are the exits
    _, alive = psutil.wait_procs(tree, timeout=600)
    assert alive == [], [_cmdline(p) for p in alive]
