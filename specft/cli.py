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
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specft.errors import ConfigError, SpecftError
from specft.logs import setup_logging
from specft.paths import conf_dir

COMMANDS = ("cache", "train", "eval", "export", "plan", "info")
USAGE = f"""usage: specft {{{','.join(COMMANDS)}}} [key=value ...] [-m key=a,b ...]
       specft info CACHE_DIR [--verify]  # what a cache holds; --verify checks every checksum
       specft export CHECKPOINT OUT_DIR [--layout eagle3|speculators|mtp] [--quant auto|none|fp8|mxfp4]

  specft train model=tiny_qwen3 quant=mxfp4 trainer.max_steps=30
  specft cache model=smollm2_135m quant=fp8
  specft train -m quant=bf16,mxfp4        # Hydra multirun: one job per value
  specft plan model=qwen3_235b_a22b quant=mxfp4 'plan.devices=[8,16,32]'   # memory per rank
  specft eval quant=mxfp4 'eval.drafts=[runs/a,runs/b]' 'eval.k=[3,4,5]'

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


def compose(overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from specft.config import register_schema

    register_schema()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        try:
            return hydra_compose("config", overrides=_dict_overrides_merge(overrides))
        except Exception as err:
            cause = err.__cause__
            detail = f" ({str(cause).splitlines()[0]})" if cause else ""
            raise ConfigError(f"{str(err).splitlines()[0]}{detail}") from None


def validate_overrides(overrides: list[str]) -> None:
    from specft.validate import to_schema

    groups = _groups()
    for combo in _expand_overrides(overrides):
        for o in combo:
            _check_group_choice(o, groups)
        cfg = compose(combo)
        OmegaConf.update(cfg, "run_dir", "unset", force_add=True)
        to_schema(cfg)


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


def _check_writable_places(root, command: str) -> None:
    from specft.paths import models_dir, require_writable_dir
    from specft.target.loader import local_build_dir

    if command == "eval":
        require_writable_dir(root.eval.out_dir or Path(root.run_dir) / "eval", "eval.out_dir")
    else:
        require_writable_dir(root.run_dir, "run_dir (runs/ under the working directory by default)")
        require_writable_dir(root.cache.dir or root.cache.root, "cache.dir" if root.cache.dir else "cache.root")
    build_dir = local_build_dir(root.model)
    if build_dir is not None and not build_dir.is_dir():
        require_writable_dir(models_dir(), "SPECFT_HOME (where specft builds local models)")


def _task(command: str):
    def task(hydra_cfg: DictConfig) -> None:
        try:
            _run_job(command, hydra_cfg)
        except SpecftError as err:
            # Hydra turns exceptions into tracebacks and exit 1; bad input is one line, exit 2.
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        except KeyboardInterrupt:
            resume = "" if command == "eval" else "; the same command resumes from the last checkpoint / shard"
            print(f"interrupted: specft {command} stopped (run dir {hydra_cfg.get('run_dir')}){resume}",
                  file=sys.stderr)
            raise SystemExit(INTERRUPTED) from None

    return task


def _run_job(command: str, hydra_cfg: DictConfig) -> None:
    """Resolve, validate and save the config, then run one job's ranks."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from specft.data import check_data_files
    from specft.launch import launch_ranks, run_subprocess_rank
    from specft.rundir import check_resume, write_atomic
    from specft.validate import to_schema
    from specft.worker import run

    setup_logging()  # Hydra reconfigures logging per job
    cfg = OmegaConf.create(OmegaConf.to_container(hydra_cfg, resolve=True))
    _absolute_paths(cfg)
    cfg.meta = {"git_sha": _git_sha(), "command": command, "argv": sys.argv[1:]}
    root = to_schema(cfg)
    run_dir = Path(root.run_dir)
    # Everything is checked before anything is written: a refused command changes no file.
    check_data_files(root.data)
    _check_writable_places(root, command)
    if command == "eval":  # reads a run; writes only under its eval dir, once it has results
        from specft.eval import run_eval

        out = run_eval(root)
        write_atomic(out / "config.yaml", OmegaConf.to_yaml(cfg))
        return
    check_resume(run_dir, OmegaConf.to_container(cfg))
    config_path = run_dir / "config.yaml"
    try:
        write_atomic(config_path, OmegaConf.to_yaml(cfg))
    except OSError as err:
        raise SpecftError(f"run_dir: cannot write {config_path}: {err.strerror or err}") from None
    log.info("%s: run dir %s", command, run_dir)
    if root.trainer.nproc > 1 or root.trainer.hostfile:
        launch_ranks(config_path, command, root.trainer.nproc, root.trainer.hostfile, root.trainer.num_nodes)
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


def _export(args: list[str]) -> int:
    import argparse

    from specft.drafts.layouts import LAYOUTS
    from specft.export import QUANT_KINDS, export_draft

    parser = argparse.ArgumentParser(prog="specft export", description="Write a trained draft in a "
                                     "layout serving engines load.")
    parser.add_argument("checkpoint", help="a run dir, its checkpoints/final, or a checkpoint folder")
    parser.add_argument("out_dir")
    parser.add_argument("--layout", default="eagle3", choices=sorted(LAYOUTS.names))
    parser.add_argument("--quant", default="auto", choices=QUANT_KINDS,
                        help="auto: the draft's QAT format (16-bit when it has none)")
    parser.add_argument("--target-head", help="target_head.safetensors of the cache (mtp with a reduced vocab)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in a non-empty OUT_DIR")
    ns = parser.parse_args(args)
    try:
        out = export_draft(ns.checkpoint, ns.out_dir, ns.layout, ns.quant, ns.target_head, ns.dtype,
                           ns.overwrite)
    except SpecftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {ns.layout} draft to {out}")
    return 0


def _plan(overrides: list[str]) -> int:
    """Arithmetic only: composed without a Hydra job (nothing is written)."""
    from specft.plan import run_plan
    from specft.validate import to_schema

    cfg = compose(overrides)
    OmegaConf.update(cfg, "run_dir", "unset", force_add=True)
    try:
        run_plan(to_schema(cfg))
    except SpecftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


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
    if command in ("info", "plan") and any(a in ("-h", "--help") for a in overrides):
        print(USAGE)  # these two take no Hydra flags: their help is specft's own
        return 0
    if command == "info":
        return _info(overrides)
    if command == "export":
        setup_logging()
        return _export(overrides)
    setup_logging()
    hydra_flags = [a for a in overrides if a.startswith("-")]
    plain = _dict_overrides_merge([a for a in overrides if not a.startswith("-")])
    try:
        validate_overrides(plain)
    except SpecftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if command == "plan":
        return _plan(plain)
    from specft.config import register_schema

    register_schema()
    sys.argv = [f"specft {command}", *hydra_flags, *plain]
    app = hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_task(command))
    try:
        app()
    except SpecftError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
