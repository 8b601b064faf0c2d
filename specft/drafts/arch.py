"""The draft architecture registry, keyed by the architecture string draft_config.json
records (``draft.name`` when training). Train, eval, export and config validation look an
architecture up here; a new one is a folder under specft/drafts/ that registers a
DraftArch, plus conf/draft/<name>.yaml (docs/extending.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from specft.decoding.draft import ChainRunner
from specft.drafts.layers import DraftHeadConfig
from specft.drafts.vocab import DraftVocab
from specft.registry import Registry


@dataclass(frozen=True)
class DraftArch:
    # Training: (head config, target tensors {embed_tokens, draft_rows}, vocabulary) -> head.
    build: Callable[[DraftHeadConfig, dict, DraftVocab], nn.Module]
    # Loading a checkpoint: the head with placeholder tensors, its state dict loaded after.
    empty: Callable[[DraftHeadConfig], nn.Module]
    layouts: tuple[str, ...]  # export layouts (specft/drafts/layouts.py) that carry it
    # Checks of the draft config against the target (ConfigError, one line), or None.
    check: Callable | None = None
    runner: type = ChainRunner  # drafting with a KV cache at decode time
    # draft.init=target_layer: (head, a target decoder layer) -> names copied, or None.
    init_from_layer: Callable | None = None
    # (draft config, model config) -> the architecture's resolved options (defaults filled,
    # values checked with ConfigError), kept in DraftHeadConfig.options; None: it takes none.
    options: Callable | None = None
    # draft config -> the most tokens one round may draft (a parallel drafter's trained
    # slots); None: a chain drafter drafts any k.
    max_draft_tokens: Callable | None = None


DRAFT_ARCHS: Registry[DraftArch] = Registry("draft architecture")


def register_draft(name: str, arch: DraftArch) -> DraftArch:
    return DRAFT_ARCHS.register(name)(arch)
