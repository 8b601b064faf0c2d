"""`specft <command> [hydra overrides]`: cache | train | eval.

The overrides are checked (every combination of a -m sweep) before Hydra runs a job, so
a bad value is one line naming the field and what is allowed, exit code 2, and nothing
is written.
"""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from specft.common.disk import is_disk_full, job_disk_full_line
from specft.common.errors import ConfigError, ReportedError, SpecftError
from specft.common.interrupts import watching_sigint
from specft.common.logs import setup_logging
from specft.common.paths import conf_dir

COMMANDS = ("cache", "train", "eval", "export", "fold-rotation", "plan", "distance", "info")
JOB_COMMANDS = ("cache", "train", "eval")  # Hydra jobs: checked whole before Hydra runs
USAGE = f"""usage: specft {{{','.join(COMMANDS)}}} [key=value ...] [-m key=a,b ...]
       specft info CACHE_DIR [--verify]  # what a cache holds; --verify checks every checksum
       specft export CHECKPOINT OUT_DIR [--layout eagle3|speculators|mtp|dflash|gguf|...] [--quant auto|none|fp8|mxfp4]
                                        # CHECKPOINT: a run dir (its final, else its latest step), a step folder
       specft fold-rotation CHECKPOINT OUT_DIR --rotation QUANT|R1.safetensors|CKPT
                                        # a 16-bit draft for a rotated target

  specft train model=tiny_qwen3 quant=mxfp4 trainer.max_steps=30
  specft cache model=smollm2_135m quant=fp8
  specft train -m quant=bf16,mxfp4        # Hydra multirun: one job per value; a failed job
                                          # is reported at the end, the others still run
                                          # (--fail-fast: stop at the first failure)
  specft plan model=qwen3_235b_a22b quant=mxfp4 'plan.devices=[8,16,32]'   # memory per rank
  specft eval quant=mxfp4 'eval.drafts=[runs/a,runs/b]' 'eval.k=[3,4,5]'
  specft distance model=hf model.path=CKPT quant=checkpoint distance.reference=BF16_DIR   # retrain my draft?

Config groups: model, quant, draft, loss, data, cache, trainer, logger, eval (see conf/)."""

log = logging.getLogger("specft")


def _groups() -> dict[str, list[str]]:
    root = conf_dir()
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in root.iterdir() if d.is_dir()
            and any(d.glob("*.yaml"))}


def _expand_overrides(overrides: list[str]) -> list[list[str]]:
    """Every combination a sweep would run, as plain override lists."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:  # hydra raises its own OverrideParseException
        raise ConfigError(f"bad override: {str(err).splitlines()[0]}") from None
    choices = []
    for o in parsed:
        key = o.get_key_element()
        if o.is_sweep_override():
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(c) for c in itertools.product(*choices)]


def _dict_overrides_merge(overrides: list[str]) -> list[str]:
    """``key={a: 1}`` as ``++key={a: 1}``: OmegaConf cannot merge new keys into a typed
    dict field in struct mode ('Key a is not in struct'); a forced update can. An unknown
    key still fails: the schema merge rejects it."""
    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        out.append(f"++{o}" if eq and not key.startswith(("+", "~")) and value.lstrip().startswith("{") else o)
    return out


def _check_group_choice(override: str, groups: dict[str, list[str]]) -> None:
    key, _, value = override.partition("=")
    key = key.lstrip("+~")
    if key in groups and value not in groups[key]:
        raise ConfigError(f"{key}: unknown value {value!r}; allowed: {', '.join(groups[key])}")


def compose(overrides: list[str], with_hydra: bool = False) -> DictConfig:
    """The config a job would get; ``with_hydra`` keeps the ``hydra`` node (run dirs)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from specft.config import register_schema

    register_schema()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        try:
            return hydra_compose("config", overrides=_dict_overrides_merge(overrides),
                                 return_hydra_config=with_hydra)
        except Exception as err:
            cause = err.__cause__
            detail = f" ({str(cause).splitlines()[0]})" if cause else ""
            raise ConfigError(f"{str(err).splitlines()[0]}{detail}") from None


def _job_run_dir(cfg: DictConfig, multirun: bool) -> str:
    """The directory Hydra will give the job (hydra.run.dir, or the sweep's subdir)."""
    if multirun:
        return str(Path(cfg.hydra.sweep.dir) / str(cfg.hydra.sweep.subdir))
    return str(cfg.hydra.run.dir)


def validate_overrides(overrides: list[str], command: str | None = None, multirun: bool = False) -> int:
    """Check every job a command line would run; returns their number. For cache, train
    and eval this includes every input the job reads (preflight.py), so a refused
    command leaves no run directory behind."""
    from specft.commands.preflight import check_before_writing
    from specft.commands.validate import to_schema

    groups = _groups()
    combos = _expand_overrides(overrides)
    for combo in combos:
        for o in combo:
            _check_group_choice(o, groups)
        cfg = compose(combo, with_hydra=command in JOB_COMMANDS)
        run_dir = _job_run_dir(cfg, multirun) if command in JOB_COMMANDS else "unset"
        with open_dict(cfg):
            cfg.pop("hydra", None)
        OmegaConf.update(cfg, "run_dir", run_dir, force_add=True)
        if command in JOB_COMMANDS:
            _absolute_paths(cfg)
            check_before_writing(to_schema(cfg), OmegaConf.to_container(cfg, resolve=True), command)
        else:
            to_schema(cfg)
    return len(combos)


def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _absolute_paths(cfg: DictConfig) -> None:
    """Ranks and later commands may run elsewhere: make every path absolute now."""
    for key in ("run_dir", "cache.root", "cache.dir", "data.path", "eval.out_dir", "trainer.hostfile"):
        value = OmegaConf.select(cfg, key)
        if value:
            OmegaConf.update(cfg, key, str(Path(value).expanduser().resolve()))


INTERRUPTED = 130  # the shell's code for a command ended by SIGINT


class JobTally:
    """What became of each job of a multirun: finished, failed (with its one line), or
    skipped after a failure under --fail-fast."""

    def __init__(self, total: int, fail_fast: bool):
        self.total, self.fail_fast = total, fail_fast
        self.finished: list[str] = []
        self.failed: list[tuple[str, str]] = []

    def summary(self) -> str:
        skipped = self.total - len(self.finished) - len(self.failed)
        lines = [f"multirun: {self.total} jobs: {len(self.finished)} finished, {len(self.failed)} failed, "
                 f"{skipped} skipped" + (" (--fail-fast)" if skipped else "")]
        lines += [f"  failed: {name}: {line}" for name, line in self.failed]
        return "\n".join(lines)


def _job_name() -> str:
    from hydra.core.hydra_config import HydraConfig

    job = HydraConfig.get().job
    return f"#{job.num} {job.override_dirname or '(no overrides)'}"


def _task(command: str, tally: JobTally | None = None):
    def task(hydra_cfg: DictConfig) -> None:
        with watching_sigint() as sigint:
            try:
                _run_job(command, hydra_cfg)
            except KeyboardInterrupt:
                _interrupted(command, hydra_cfg)
            except Exception as err:
                if sigint.seen and not isinstance(err, SpecftError):  # a library's error for the Ctrl-C
                    _interrupted(command, hydra_cfg)
                _failed(hydra_cfg, err, tally)
                return
        if tally is not None:
            tally.finished.append(_job_name())

    return task


def _interrupted(command: str, hydra_cfg: DictConfig) -> None:
    resume = "" if command == "eval" else "; the same command resumes from the last checkpoint / shard"
    print(f"interrupted: specft {command} stopped (run dir {hydra_cfg.get('run_dir')}){resume}", file=sys.stderr)
    raise SystemExit(INTERRUPTED) from None


def _failed(hydra_cfg: DictConfig, err: Exception, tally: JobTally | None) -> None:
    """A job's error: bad input (SpecftError) and a full disk are one line and exit 2
    (a multirun goes on unless --fail-fast); anything else propagates."""
    if isinstance(err, SpecftError):
        # Hydra turns exceptions into tracebacks and exit 1; bad input is one line, exit 2.
        line = str(err)
        if not isinstance(err, ReportedError):  # a rank process printed its own line
            print(f"error: {line}", file=sys.stderr)
        if tally is None or tally.fail_fast:
            if tally is not None:
                tally.failed.append((_job_name(), line))
            raise SystemExit(2) from None
        tally.failed.append((_job_name(), line))
        return
    if not is_disk_full(err):
        raise err
    print(f"error: {job_disk_full_line(str(hydra_cfg.get('run_dir')))}", file=sys.stderr)
    raise SystemExit(2) from None


def _cache_locks(root, command: str, stack) -> None:
    """Lock every cache this job will build (not those complete already, which it only
    reads): two builds of one cache would write the same shards. cache.wait=true waits
    for another builder instead of refusing; if that one finished the cache, it is read."""
    from specft.cache import locate_cache
    from specft.cache.writer import cache_is_complete
    from specft.commands.pipeline import caches_needed
    from specft.common.lock import dir_lock

    for cfg in caches_needed(root, command):
        cache_dir, provenance, _ = locate_cache(cfg)
        if cache_is_complete(cache_dir, provenance):
            continue
        lock = dir_lock(cache_dir, "cache").acquire(wait=cfg.cache.wait)
        if cache_is_complete(cache_dir, provenance):  # its builder finished it while we waited
            lock.release()
        else:
            stack.callback(lock.release)


def _write_run_config(run_dir: Path, cfg: DictConfig) -> Path:
    """config.yaml, unless it already says the same (a rerun that resumes leaves it as
    it was; only resume-safe fields such as trainer.max_steps may differ, and then the
    file records the settings the run now goes on with)."""
    from specft.common.rundir import same_run_config, write_atomic

    config_path = run_dir / "config.yaml"
    if same_run_config(config_path, OmegaConf.to_container(cfg)):
        return config_path
    try:
        write_atomic(config_path, OmegaConf.to_yaml(cfg))
    except OSError as err:
        raise SpecftError(f"run_dir: cannot write {config_path}: {err.strerror or err}") from None
    return config_path


def _run_job(command: str, hydra_cfg: DictConfig) -> None:
    """Resolve, check and save the config, then run one job's ranks."""
    from specft.commands.preflight import check_before_writing
    from specft.commands.validate import to_schema
    from specft.common.rundir import RefusalUndo

    setup_logging()  # Hydra reconfigures logging per job
    cfg = OmegaConf.create(OmegaConf.to_container(hydra_cfg, resolve=True))
    _absolute_paths(cfg)
    cfg.meta = {"git_sha": _git_sha(), "command": command, "argv": sys.argv[1:]}
    root = to_schema(cfg)
    run_dir = Path(root.run_dir)
    # Everything is checked before anything is written: a refused command changes no file
    # (the checks probe that the places are writable; refusals from the ranks come later).
    undo = RefusalUndo(run_dir, [run_dir.parent, Path(root.cache.root)])
    try:
        check_before_writing(root, OmegaConf.to_container(cfg), command)
        _write_and_run(command, root, cfg, run_dir)
    except SpecftError:
        undo.undo()
        raise
    if command == "eval":  # it wrote under eval.out_dir only
        undo.remove_bare_folders()


def _write_and_run(command: str, root, cfg: DictConfig, run_dir: Path) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from specft.commands.worker import run
    from specft.common.launch import NodeLaunch, launch_ranks, run_subprocess_rank
    from specft.common.rundir import write_atomic

    if command == "eval":  # reads a run; writes only under its eval dir, once it has results
        from specft.eval import run_eval

        out = run_eval(root)
        write_atomic(out / "config.yaml", OmegaConf.to_yaml(cfg))
        return
    t = root.trainer
    node = NodeLaunch(t.node_rank, t.master_addr, t.master_port) if t.node_rank is not None else None
    if node is not None and node.node_rank > 0:
        # Another node's share of a run node 0 leads: node 0 holds the locks and writes
        # the run config; this node starts its ranks from a node-local copy of the config.
        log.info("%s: node %d of %d, ranks join node 0 at %s:%d; run dir %s", command, node.node_rank,
                 t.num_nodes, node.master_addr, node.master_port, run_dir)
        config_path = Path(tempfile.mkdtemp(prefix="specft-node-")) / "config.yaml"
        write_atomic(config_path, OmegaConf.to_yaml(cfg))
        launch_ranks(config_path, command, t.nproc, t.hostfile, t.num_nodes, node)
        return
    from contextlib import ExitStack

    from specft.common.lock import dir_lock

    with ExitStack() as locks:
        locks.enter_context(dir_lock(run_dir, "run_dir", f"specft {command}"))
        _cache_locks(root, command, locks)
        config_path = _write_run_config(run_dir, cfg)
        log.info("%s: run dir %s", command, run_dir)
        if t.nproc > 1 or t.hostfile or node is not None:
            launch_ranks(config_path, command, t.nproc, t.hostfile, t.num_nodes, node)
        elif HydraConfig.get().mode == RunMode.MULTIRUN:
            run_subprocess_rank(config_path, command)
        else:
            run(root, command)


def _info(args: list[str]) -> int:
    from specft.cache.info import describe

    verify = "--verify" in args
    args = [a for a in args if a != "--verify"]
    if len(args) != 1:
        print("error: usage: specft info CACHE_DIR [--verify]", file=sys.stderr)
        return 2
    try:
        text, damage = describe(args[0], verify)
    except SpecftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    if damage:
        print(f"error: {damage[0].line(Path(args[0]))}", file=sys.stderr)
        return 2
    return 0


def _draft_command_parser(prog: str, description: str):
    """A command that reads a trained draft: its CHECKPOINT argument, as eval/drafts.py's
    resolve_checkpoint takes it."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("checkpoint", help="a run dir (its final checkpoint, else its latest step while it "
                        "trains), its checkpoints/ folder or latest file, or a checkpoint folder")
    return parser


def _export(args: list[str]) -> int:

    from specft.drafts.layouts import LAYOUTS
    from specft.export import QUANT_KINDS, ExportOptions, export
    from specft.export.gguf import GGUF_VOCABULARIES

    parser = _draft_command_parser("specft export", "Write a trained draft in a layout serving engines load.")
    parser.add_argument("out_dir")
    parser.add_argument("--layout", default="eagle3", choices=LAYOUTS.names,
                        help="gguf: llama.cpp's draft file, through its own converter (docs/serving.md)")
    parser.add_argument("--quant", default="auto", choices=QUANT_KINDS,
                        help="auto: the draft's QAT format (16-bit when it has none)")
    parser.add_argument("--target-head", help="target_head.safetensors of the cache (mtp with a reduced vocab)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in a non-empty OUT_DIR")
    parser.add_argument("--gguf-type", default="f16", help="--layout gguf: the draft's weights as f16 (default), "
                        "bf16, f32, q8_0 or q4_0")
    parser.add_argument("--gguf-vocab", default="target", choices=GGUF_VOCABULARIES,
                        help="--layout gguf: what the draft carries of the target's tokenizer: target (default; "
                        "any llama.cpp) or none (eagle3: less server memory; llama-server -v needs "
                        "`make llamacpp`'s patched build)")
    parser.add_argument("--target", help="--layout gguf: the target's checkpoint dir or .gguf (default: the "
                        "one the draft was trained against)")
    ns = parser.parse_args(args)
    options = ExportOptions(quant=ns.quant, target_head=ns.target_head, dtype=ns.dtype, gguf_type=ns.gguf_type,
                            gguf_vocab=ns.gguf_vocab, target=ns.target, overwrite=ns.overwrite)
    try:
        out = export(ns.checkpoint, ns.out_dir, ns.layout, options)
    except SpecftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {ns.layout} draft to {out}")
    return 0


def _fold_rotation(args: list[str]) -> int:

    from specft.export.rotation_fold import fold_rotation

    parser = _draft_command_parser("specft fold-rotation", "Fold a target's residual rotation into a 16-bit "
                                   "EAGLE-3 draft, so it drafts for the rotated target untrained.")
    parser.add_argument("out_dir", help="the folded draft's checkpoint folder (eval and export read it)")
    parser.add_argument("--rotation", required=True,
                        help="a quant config with a rotation block (w8a8_int8_quarot), a .safetensors file "
                             "holding R1 (the quantizer's, or scripts/recover_rotation.py's), or a "
                             "checkpoint folder that saved its R1 (msModelSlim QuaRot)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier fold in a non-empty OUT_DIR")
    ns = parser.parse_args(args)
    try:
        out = fold_rotation(ns.checkpoint, ns.out_dir, ns.rotation, ns.overwrite)
    except SpecftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"folded the rotation into the draft at {out}")
    return 0


def _without_job(run, overrides: list[str]) -> int:
    """A command composed without a Hydra job (no run dir): `plan` (arithmetic only) and
    `distance` (reads two models; writes only distance.out when given)."""
    from specft.commands.validate import to_schema

    cfg = compose(overrides)
    OmegaConf.update(cfg, "run_dir", "unset", force_add=True)
    try:
        run(to_schema(cfg))
    except SpecftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _plan(overrides: list[str]) -> int:
    from specft.commands.plan import run_plan

    return _without_job(run_plan, overrides)


def _distance(overrides: list[str]) -> int:
    from specft.commands.distance import run_distance

    return _without_job(run_distance, overrides)


# Commands on files (argparse, no Hydra job).
FILE_COMMANDS = {"export": _export, "fold-rotation": _fold_rotation}


def main(argv: list[str] | None = None) -> int:
    import hydra

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, overrides = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; allowed: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if command in ("info", "plan", "distance") and any(a in ("-h", "--help") for a in overrides):
        print(USAGE)  # these take no Hydra flags: their help is specft's own
        return 0
    if command == "info":
        return _info(overrides)
    if command in FILE_COMMANDS:
        setup_logging()
        return FILE_COMMANDS[command](overrides)
    setup_logging()
    fail_fast = "--fail-fast" in overrides
    overrides = [a for a in overrides if a != "--fail-fast"]
    hydra_flags = [a for a in overrides if a.startswith("-")]
    multirun = any(f in ("-m", "--multirun") for f in hydra_flags)
    plain = _dict_overrides_merge([a for a in overrides if not a.startswith("-")])
    try:
        jobs = validate_overrides(plain, command, multirun)
    except SpecftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if command == "plan":
        return _plan(plain)
    if command == "distance":
        return _distance(plain)
    from specft.config import register_schema

    register_schema()
    tally = JobTally(jobs, fail_fast) if multirun else None
    sys.argv = [f"specft {command}", *hydra_flags, *plain]
    app = hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_task(command, tally))
    try:
        app()
    except SpecftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SystemExit as stop:
        if tally is None or stop.code == INTERRUPTED:
            raise
    if tally is not None:
        print(tally.summary(), file=sys.stderr)
        return 2 if tally.failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
