"""The wheel as users install it: built from the tree, installed into a fresh virtual
environment, run from outside the source tree. An editable install cannot show a
subpackage the wheel leaves out; this does."""

import os
import pkgutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import specft

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ("cache", "train", "eval", "export", "plan", "distance", "info")


def _subpackages() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(specft.__path__, "specft.") if m.ispkg)


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """(python of a fresh venv holding only the built wheel + this interpreter's deps, a cwd outside the repo)."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(root / "dist"), str(REPO)], check=True, capture_output=True, timeout=3600)
    wheel = next((root / "dist").glob("specft-*.whl"))
    # The dependencies (torch, transformers, ...) are this interpreter's, seen without a
    # download through a .pth after the venv's own site-packages, where the wheel's specft
    # comes first. Not system_site_packages: from inside the user's venv that would give
    # the base interpreter's packages (none on a fresh machine), not the venv's.
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    (own,) = (root / "venv" / "lib").glob("python*/site-packages")
    (own / "specft_test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                    str(wheel)], check=True, capture_output=True, timeout=3600)
    work = root / "work"
    work.mkdir()
    return python, work


def _run(python, cwd, *args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(python), *args], cwd=cwd, capture_output=True, text=True, timeout=3600, env=env)


def test_every_subpackage_imports_from_the_installed_wheel(wheel_env):
    python, work = wheel_env
    names = _subpackages()
    assert {"specft.eval", "specft.export", "specft.decoding", "specft.train", "specft.conf"} <= set(names)
    code = ("import importlib, specft, sys\n"
            f"for n in {names!r}: importlib.import_module(n)\n"
            "print(specft.__file__)")
    proc = _run(python, work, "-c", code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "site-packages" in proc.stdout and str(REPO) not in proc.stdout, proc.stdout


def test_the_wheel_runs_on_this_interpreters_dependencies(wheel_env):
    """Run from a user's venv, the dependencies are the venv's (a fresh machine's base
    interpreter has none), not the base interpreter's."""
    import torch

    python, work = wheel_env
    proc = _run(python, work, "-c", "import torch; print(torch.__file__)")
    assert proc.returncode == 0 and proc.stdout.strip() == torch.__file__, (proc.stdout, proc.stderr[-1000:])


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_helps_from_the_installed_wheel(wheel_env, command):
    python, work = wheel_env
    proc = _run(python, work, "-m", "specft.cli", command, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() and "Traceback" not in proc.stderr
