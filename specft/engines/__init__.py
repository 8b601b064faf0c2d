"""The ways of running the target (engines), one registry: specft's own engine over the
loaded torch model (specft_engine.py, its answers in generate.py), an OpenAI-compatible
server serving the checkpoint (server.py, its client openai_server.py), llama.cpp's own
library (llamacpp.py). base.py holds the registry and the roles' Protocols. Every module
here is imported below, so a new engine is one module with no list edited
(docs/extending.md). `specft eval` counts a draft's acceptance in specft's decode loop over
the loaded target; llama.cpp's own counters are scripts/benchmarks/bench_llamacpp.py's."""

import importlib
import pkgutil

from specft.engines.base import (
    ENGINES,
    Answerer,
    AnswerRole,
    Answers,
    Capture,
    Engine,
    EngineUnreachable,
    FeatureRole,
    Features,
    engine_for,
)

# Every module is imported, and each engine's registers itself: a new one needs no line here.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ENGINES", "AnswerRole", "Answerer", "Answers", "Capture", "Engine", "EngineUnreachable", "FeatureRole",
           "Features", "engine_for"]
