"""specft's own engine: the target loaded in torch (quantized as it is served, or as the
checkpoint's files say), answering with the decode loop `specft eval` measures and handing
out the features by forward hooks. Its name is ``specft`` for both roles; ``torch``, the
name cache.engine gave it first (and still its default), is kept as another name for it."""

from __future__ import annotations

from specft.config import RegenerateConfig, RootConfig, aux_layer_ids
from specft.engines.base import ENGINES, AnswerRole, Engine, FeatureRole


def _answerer(rc: RegenerateConfig):
    from specft.engines import generate

    return lambda model, tokenizer, prompts, seed, synced: generate.generate_batch(model, tokenizer, prompts, rc, seed,
                                                                                  synced=synced)


def _capture(cfg: RootConfig, model):
    from specft.target_model import FeatureCapture

    return FeatureCapture(model, aux_layer_ids(cfg.model))


def _nothing(cfg: RootConfig) -> dict:
    return {}


def _no_check(cfg: RootConfig) -> None:
    return None


SPECFT = Engine(
    "specft's engine over the target loaded in torch",
    answers=AnswerRole(validate=_no_check, provenance=_nothing, answerer=_answerer),
    features=FeatureRole(validate=_no_check, check_ready=_no_check, capture=_capture, provenance=_nothing))

ENGINES.register("specft")(SPECFT)
ENGINES.alias("torch", "specft")
