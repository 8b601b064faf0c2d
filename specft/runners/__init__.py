"""The ways of running the target, behind one registered interface (as quant formats and
drafters are): specft's own engine over the loaded torch model, an OpenAI-compatible
server (llama-server, vLLM, SGLang) serving the checkpoint, llama.cpp's own library.

A runner plays one or both of two roles:

- ``answers``: it writes the target's answers to the data's prompts (data.regenerate.engine);
- ``features``: it computes the hidden states stage 1 caches and online training reads
  (cache.engine).

Each role names its config check (one line at config time, nothing loaded), what it adds
to the cache's provenance (empty for specft's own engine, so its caches keep their names)
and the call the stage makes. `specft eval` counts a draft's acceptance in specft's decode
loop over the loaded target (the specft runner); llama.cpp's own counters are
scripts/bench_llamacpp.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specft.config import RootConfig
from specft.errors import ConfigError, SpecftError
from specft.registry import Registry


@dataclass(frozen=True)
class AnswerRole:
    validate: Callable[[RootConfig], None]
    # the answers' identity beyond the target and generation settings (provenance, answer key)
    provenance: Callable[[RootConfig], dict]
    # (regenerate config) -> answer(model, tokenizer, prompts, seed, synced) ->
    # (each row's answer ids up to its stop, or None where the engine cut it short,
    #  whether the row hit max_new_tokens)
    answerer: Callable


@dataclass(frozen=True)
class FeatureRole:
    validate: Callable[[RootConfig], None]
    # fails in one line when the engine is missing on this machine (before any work)
    check_ready: Callable[[RootConfig], None]
    # (cfg, the served torch model) -> capture(input_ids, attention_mask) -> (aux, final)
    capture: Callable
    # what the features depend on beyond the target, data and quant config
    provenance: Callable[[RootConfig], dict]


@dataclass(frozen=True)
class TargetRunner:
    description: str
    answers: AnswerRole | None = None
    features: FeatureRole | None = None


TARGET_RUNNERS: Registry[TargetRunner] = Registry("target runner")

# The config field that picks the runner of each role.
ROLE_FIELDS = {"answers": "data.regenerate.engine", "features": "cache.engine"}


def runner_for(role: str, name: str) -> AnswerRole | FeatureRole:
    """The ``role`` part of runner ``name``; one line when it has none."""
    field = ROLE_FIELDS[role]
    part = getattr(TARGET_RUNNERS.get(name, field), role)
    if part is None:
        able = [n for n in TARGET_RUNNERS.names if getattr(TARGET_RUNNERS.get(n), role) is not None]
        raise ConfigError(f"{field}: the target runner {name!r} does not do {role}; those that do: {', '.join(able)}")
    return part


class RunnerUnreachable(SpecftError):
    """A runner that must be asked who it is (a server) does not answer."""


# Registrations (after the interface they fill in).
from specft.runners import llamacpp, server, specft_engine  # noqa: E402,F401
