"""The draft architecture registry, keyed by the architecture string draft_config.json
records (``draft.name`` when training). Train, eval, export and config validation look an
architecture up here; a new one is a folder under specft/drafts/ that registers a
DraftArch, plus conf/draft/<name>.yaml (docs/extending.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from specft.common.errors import ConfigError
from specft.common.registry import Registry
from specft.decoding.draft import ChainRunner
from specft.drafts.layers import DraftHeadConfig
from specft.drafts.vocab import DraftVocab


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
    # How many target layers (model.aux_layer_ids, cached by stage 1) it fuses; None: any.
    feature_layers: int | None = 3


DRAFT_ARCHS: Registry[DraftArch] = Registry("draft architecture")


def register_draft(name: str, arch: DraftArch) -> DraftArch:
    return DRAFT_ARCHS.register(name)(arch)


MASK_OPTIONS = ("mask_token_id",)


def mask_token_options(draft, model) -> dict:
    """mask_token_id: the token the mask slots embed (null: the target vocabulary's last
    id). The embedding is the target's, frozen: any id serves, the draft's own weights
    learn what a mask slot means. Parallel drafters (peagle, dflash) share this."""
    unknown = sorted(set(draft.options) - set(MASK_OPTIONS))
    if unknown:
        raise ConfigError(f"draft.options: a {draft.name} draft takes {', '.join(MASK_OPTIONS)}; got {unknown}")
    mask = draft.options.get("mask_token_id")
    mask = model.vocab_size - 1 if mask is None else mask
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < model.vocab_size:
        raise ConfigError(f"draft.options.mask_token_id: a token id of the target, 0..{model.vocab_size - 1}; "
                          f"got {mask!r}")
    return {"mask_token_id": mask}
