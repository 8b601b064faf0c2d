"""What an export says about its verifier (the target model it drafts for): where the
target lives (an absolute directory or a hub id, so `vllm serve EXPORT` finds it), its
architectures and its position limit.

Drafts trained since these facts were recorded carry them in draft_config.json
(``verifier``); for older ones they are found again from the run's model config."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import yaml

from specft.common.errors import SpecftError

log = logging.getLogger(__name__)

# The target facts an export passes to a serving engine (recorded in draft_config.json).
VERIFIER_KEYS = ("name_or_path", "architectures", "max_position_embeddings", "family")


def verifier_facts(folder: Path, draft_config: dict) -> dict:
    """{name_or_path, architectures, max_position_embeddings, family} of the target,
    each possibly None when nothing records it."""
    facts = dict(draft_config.get("verifier") or {})
    if not facts.get("name_or_path"):
        facts = {**_from_run_config(folder), **facts}
    return {k: facts.get(k) for k in VERIFIER_KEYS}


def _from_run_config(folder: Path) -> dict:
    """Resolve the target from the run's config.yaml (as the cache did) and read its
    config.json when it is a local directory. The run wrote its model section resolved,
    so it is read onto the schema alone."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from specft.config import ModelConfig
    from specft.target_model.loader import MODEL_SOURCES

    run_yaml = folder / "config.yaml"
    if not run_yaml.exists():
        return {}
    try:
        section = (yaml.safe_load(run_yaml.read_text()) or {}).get("model") or {}
        model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), section))
        where, gguf_file = MODEL_SOURCES.get(model.source, "model.source")(model)
    except (SpecftError, OmegaConfBaseException) as err:
        log.warning("export: cannot find the target from %s (%s); the verifier is left unnamed", run_yaml, err)
        return {}
    facts = {"family": model.family, "name_or_path": where}
    config_json = Path(where) / "config.json" if where else None
    if config_json is not None and config_json.is_file() and not gguf_file:
        hf = json.loads(config_json.read_text())
        facts.update(name_or_path=str(Path(where).resolve()), architectures=hf.get("architectures"),
                     max_position_embeddings=hf.get("max_position_embeddings"))
    return facts
