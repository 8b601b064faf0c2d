"""Several nodes without ssh: one `specft` per node with its trainer.node_rank, here two
"nodes" on this machine (gloo, one rank each) against two ranks on one node."""

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from specft.launch import free_port

from conftest import run_cli

COMMON = ["train", "model=tiny_qwen3", "quant=mxfp4", "data.num_samples=24", "trainer.max_steps=4",
          "trainer.micro_batch_size=2"]


def _two_nodes(args: list[str], cwd: Path) -> list[str]:
    """Node 0 and node 1 started at once, as a user starts them on two hosts."""
    nodes = [*args, "trainer.num_nodes=2", "trainer.master_addr=127.0.0.1", f"trainer.master_port={free_port()}"]
    procs = [subprocess.Popen([sys.executable, "-m", "specft.cli", *nodes, f"trainer.node_rank={r}"], cwd=cwd,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
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
])
def test_node_launch_refusals(tmp_path, override, message):
    proc = run_cli(["train", "model=tiny_qwen3", *override.split()], cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr
    assert list(tmp_path.iterdir()) == []
