import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


def pytest_configure(config):
    # The user's llama.cpp (make llamacpp) stays where it was installed: its default prefix
    # is under SPECFT_HOME, which the next line moves.
    from specft.llamacpp.install import prefix

    os.environ.setdefault("SPECFT_LLAMACPP", str(prefix()))
    # Tiny models are built once per test session into a private home, never ~/.cache.
    os.environ["SPECFT_HOME"] = tempfile.mkdtemp(prefix="specft-home-")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_cli(args, cwd, timeout=3600, check=True):
    """Run `specft ...` as a user would; return the CompletedProcess. ``timeout`` bounds a
    hang only: the command's own exit is the event waited on, and an hour is far past what
    any test command takes on a machine busy with other jobs."""
    proc = subprocess.run([sys.executable, "-m", "specft.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"specft {' '.join(args)} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def one_thread():
    """Tiny models decode faster on one thread (and do not fight a parallel job for cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
