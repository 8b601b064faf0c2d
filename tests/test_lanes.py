"""scripts/studies/steps.py's lanes: one command runs an experiment's parts in several processes
side by side (quant_alignment.py --lanes), each with its share of the cores, and a failed
lane stops the others rather than leaving an eval waiting for a draft forever."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "studies"))

# Stands in for an experiment script: records the parts and threads it was given, fails on
# the part `fail`, hangs on `slow` (only a stop ends it).
FAKE_SCRIPT = """
import os, pathlib, sys, time
args = sys.argv[1:]
parts, out = args[args.index("--parts") + 1], pathlib.Path(args[args.index("--out-dir") + 1])
if parts == "fail":
    sys.exit(3)
if parts == "slow":
    time.sleep(600)
(out / f"done-{parts}").write_text(os.environ["OMP_NUM_THREADS"] + " " + " ".join(args))
"""


def test_lane_commands_replace_parts_and_drop_lanes():
    from steps import lane_commands

    argv = ["--out-dir", "o", "--parts", "base", "--lanes=a,b;c", "--k", "3", "--parts=x"]
    commands = lane_commands(Path("exp.py"), argv, "a,b;c")
    assert [cmd[2:] for cmd in commands] == [["--out-dir", "o", "--k", "3", "--parts", "a,b"],
                                             ["--out-dir", "o", "--k", "3", "--parts", "c"]]
    assert all(cmd[:2] == [sys.executable, "exp.py"] for cmd in commands)


def test_one_lane_is_refused():
    from steps import lane_commands

    with pytest.raises(SystemExit, match="two or more"):
        lane_commands(Path("exp.py"), [], "base,fp8-ours")


def test_threads_per_lane_share_the_cores_unless_set():
    from steps import threads_per_lane

    assert threads_per_lane(2, {"OMP_NUM_THREADS": "3"}) == "3"
    assert int(threads_per_lane(1, {})) >= int(threads_per_lane(2, {})) >= 1
    assert threads_per_lane(10_000, {}) == "1"


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "fake_experiment.py"
    script.write_text(FAKE_SCRIPT)
    return script


def test_every_lane_runs_its_parts(tmp_path, monkeypatch):
    from steps import run_lanes

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    run_lanes(_script(tmp_path), ["--out-dir", str(out), "--parts", "ignored"], "a,b;c", out)
    assert (out / "done-a,b").read_text() == f"1 --out-dir {out} --parts a,b"
    assert (out / "done-c").read_text() == f"1 --out-dir {out} --parts c"
    assert (out / "lane-0.log").exists() and (out / "lane-1.log").exists()


def test_a_failed_lane_stops_the_others(tmp_path):
    from steps import run_lanes

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SystemExit, match=r"lane 1 failed \(exit 3\).*lane-1.log.*stopped"):
        run_lanes(_script(tmp_path), ["--out-dir", str(out)], "slow;fail", out)
    # run_lanes returned, so the hanging lane was stopped, not waited for
    assert not (out / "done-slow").exists()


def test_quant_alignment_runs_its_lanes(tmp_path):
    """The wiring: quant_alignment.py --lanes hands each lane its parts (here none: each lane
    only rewrites the summary) and summarizes once they are all done."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "studies" / "quant_alignment.py"
    out = tmp_path / "qa"
    proc = subprocess.run([sys.executable, str(script), "--out-dir", str(out), "--lanes", ";"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "[lane 0] --parts " in proc.stdout and "[lane 1] --parts " in proc.stdout
    assert (out / "lane-0.log").exists() and (out / "lane-1.log").exists()
    assert (out / "summary.md").exists()
