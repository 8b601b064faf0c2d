"""An engine is a way of running the target, registered by name (as quant formats and
drafts are). It plays one or both of two roles, each a Protocol below:

- ``answers``: it writes the target's answers to the data's prompts (data.regenerate.engine);
- ``features``: it computes the hidden states stage 1 caches and online training reads
  (cache.engine).

Each role names its config check (one line at config time, nothing loaded), what it adds
to the cache's provenance (empty for specft's own engine, so its caches keep their names)
and the call the stage makes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specft.common.errors import ConfigError, SpecftError
from specft.common.registry import Registry
from specft.config import RegenerateConfig, RootConfig


class Answerer(Protocol):
    def __call__(self, model, tokenizer, prompts: list[list[int]], seed: int,
                 synced: bool) -> tuple[Sequence[list[int] | None], Sequence[bool]]:
        """Each row's answer ids up to its stop (None where the engine cut it short), and
        whether the row hit max_new_tokens."""


class Capture(Protocol):
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the aux layers' hidden states side by side, the final post-norm hidden state)
        of a batch."""


@runtime_checkable
class Answers(Protocol):
    def validate(self, cfg: RootConfig) -> None: ...

    def provenance(self, cfg: RootConfig) -> dict:
        """The answers' identity beyond the target and generation settings."""

    def answerer(self, rc: RegenerateConfig) -> Answerer: ...


@runtime_checkable
class Features(Protocol):
    def validate(self, cfg: RootConfig) -> None: ...

    def check_ready(self, cfg: RootConfig) -> None:
        """One line when the engine is missing on this machine, before any work."""

    def capture(self, cfg: RootConfig, model) -> Capture:
        """The capture over ``model`` (the served torch model; an engine may run its own)."""

    def provenance(self, cfg: RootConfig) -> dict:
        """What the features depend on beyond the target, data and quant config."""


@dataclass(frozen=True)
class AnswerRole:
    """An Answers role made of plain functions."""
    validate: Callable[[RootConfig], None]
    provenance: Callable[[RootConfig], dict]
    answerer: Callable[[RegenerateConfig], Answerer]


@dataclass(frozen=True)
class FeatureRole:
    """A Features role made of plain functions."""
    validate: Callable[[RootConfig], None]
    check_ready: Callable[[RootConfig], None]
    capture: Callable[[RootConfig, object], Capture]
    provenance: Callable[[RootConfig], dict]


@dataclass(frozen=True)
class Engine:
    description: str
    answers: Answers | None = None
    features: Features | None = None


ENGINES: Registry[Engine] = Registry("engine")

# The config field that picks the engine of each role.
ROLE_FIELDS = {"answers": "data.regenerate.engine", "features": "cache.engine"}


def engine_for(role: str, name: str) -> Answers | Features:
    """The ``role`` part of engine ``name``; one line when it has none."""
    field = ROLE_FIELDS[role]
    part = getattr(ENGINES.get(name, field), role)
    if part is None:
        able = [n for n in ENGINES.names if getattr(ENGINES.get(n), role) is not None]
        raise ConfigError(f"{field}: the engine {name!r} does not do {role}; those that do: {', '.join(able)}")
    return part


class EngineUnreachable(SpecftError):
    """An engine that must be asked who it is (a server) does not answer."""
