"""Who writes the target's answers when data.regenerate is on (data.regenerate.engine): one
entry per engine, each a config check, what it adds to the cache's provenance, and the
call that answers one batch of prompts.

- ``specft``: specft's own decode loop over the loaded target (the one `specft eval`
  measures);
- ``server``: an OpenAI-compatible server serving the checkpoint (answer_server.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specft.config import RegenerateConfig, RootConfig
from specft.errors import ConfigError, SpecftError
from specft.registry import Registry


@dataclass(frozen=True)
class AnswerEngine:
    # Refuses a config this engine cannot serve, in one line (config time, nothing loaded).
    validate: Callable[[RootConfig], None]
    # What the answers depend on beyond the target and the generation settings: part of
    # the cache's provenance and answer key (empty for specft, so its caches keep their names).
    provenance: Callable[[RootConfig], dict]
    # (regenerate config) -> answer(model, tokenizer, prompts, seed, synced) ->
    # (each row's answer ids up to its stop, whether the row hit max_new_tokens)
    answerer: Callable[[RegenerateConfig], Callable]


ANSWER_ENGINES: Registry[AnswerEngine] = Registry("answer engine")


def _specft_answerer(rc: RegenerateConfig):
    from specft.data import generate

    return lambda model, tokenizer, prompts, seed, synced: generate.generate_batch(model, tokenizer, prompts, rc, seed,
                                                                                  synced=synced)


ANSWER_ENGINES.register("specft")(AnswerEngine(validate=lambda cfg: None, provenance=lambda cfg: {},
                                               answerer=_specft_answerer))


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
    from specft.data.answer_server import AnswerServer

    if not cfg.data.regenerate.enabled:
        return {}
    return {"answers": AnswerServer(cfg.data.regenerate.server).identity()}


def _server_answerer(rc: RegenerateConfig):
    from specft.data.answer_server import AnswerServer, check_tokens
    from specft.target_model.loader import stop_token_ids

    server = AnswerServer(rc.server)  # asks /v1/models once, at its first batch

    def answer(model, tokenizer, prompts, seed, synced):
        stops = stop_token_ids(tokenizer, model)
        answers, capped = [], []
        for row, got in enumerate(server.answer(prompts, rc, seed)):
            check_tokens(got, tokenizer, f"answer {row} of a batch")
            # up to the first stop token, as specft's own engine answers
            stop = next((j for j, t in enumerate(got.ids) if t in stops), len(got.ids))
            if got.finish_reason == "length" and len(got.ids) < rc.max_new_tokens:
                raise SpecftError(f"data.regenerate.server: an answer stopped at {len(got.ids)} of "
                                  f"data.regenerate.max_new_tokens={rc.max_new_tokens} tokens: the server's context "
                                  "per request is full. Start it with a context of at least data.max_seq_len + "
                                  "max_new_tokens per slot; the answers stored so far are kept")
            answers.append(got.ids[:stop])
            capped.append(got.finish_reason == "length")
        return answers, capped

    return answer


ANSWER_ENGINES.register("server")(AnswerEngine(validate=_validate_server, provenance=_server_provenance,
                                               answerer=_server_answerer))
