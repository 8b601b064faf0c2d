"""An OpenAI-compatible server serving the checkpoint writes the target's answers
(data.regenerate.engine=server; its client is openai_server.py). It computes no features:
stage 1 still runs the target in specft (or llama.cpp) over the answered conversations."""

from __future__ import annotations

from specft.common.errors import ConfigError
from specft.config import RegenerateConfig, RootConfig
from specft.engines.base import ENGINES, AnswerRole, Engine


def _validate_server(cfg: RootConfig) -> None:
    server = cfg.data.regenerate.server
    if not cfg.data.regenerate.enabled:
        raise ConfigError("data.regenerate.engine=server: the server writes the target's answers; it needs "
                          "data.regenerate.enabled=true")
    if not server.url or not server.url.startswith(("http://", "https://")):
        raise ConfigError("data.regenerate.server.url: data.regenerate.engine=server needs the server's address, "
                          f"as http://HOST:PORT; got {server.url}")
    for name in ("concurrency", "timeout_s", "connect_timeout_s"):
        if getattr(server, name) <= 0:
            raise ConfigError(f"data.regenerate.server.{name}: must be > 0, got {getattr(server, name)}")
    if server.retries < 0:
        raise ConfigError(f"data.regenerate.server.retries: must be >= 0, got {server.retries}")


def _server_provenance(cfg: RootConfig) -> dict:
    from specft.engines.openai_server import AnswerServer

    if not cfg.data.regenerate.enabled:
        return {}
    return {"answers": AnswerServer(cfg.data.regenerate.server).identity()}


def _server_answerer(rc: RegenerateConfig):
    from specft.engines.openai_server import AnswerServer, check_tokens
    from specft.target_model.loader import stop_token_ids

    server = AnswerServer(rc.server)  # asks /v1/models once, at its first batch

    def answer(model, tokenizer, prompts, seed, synced):
        stops = stop_token_ids(tokenizer, model)
        answers, capped = [], []
        for row, got in enumerate(server.answer(prompts, rc, seed)):
            check_tokens(got, tokenizer, f"answer {row} of a batch")
            # up to the first stop token, as specft's own engine answers
            stop = next((j for j, t in enumerate(got.ids) if t in stops), len(got.ids))
            # Stopped by length before max_new_tokens: the server's context ran out. The
            # answer is cut, not complete (None: regenerate counts it and stores nothing).
            cut = got.finish_reason == "length" and len(got.ids) < rc.max_new_tokens
            answers.append(None if cut else got.ids[:stop])
            capped.append(got.finish_reason == "length")
        return answers, capped

    return answer


ENGINES.register("server")(Engine(
    "an OpenAI-compatible server at data.regenerate.server.url",
    answers=AnswerRole(validate=_validate_server, provenance=_server_provenance, answerer=_server_answerer)))
