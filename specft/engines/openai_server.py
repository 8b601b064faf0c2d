"""The client of an OpenAI-compatible server that answers regeneration's prompts (data.regenerate.engine
=server): llama-server, vLLM or SGLang serving the checkpoint, so the answers come from the
served model's own kernels, at the engine's speed.

Prompts go to /v1/completions as token ids, rendered by specft with the target's chat
template: the answer continues exactly the prompt stage 1 caches, and the server's own
template is never involved. The answer's token ids come back with it (vLLM:
``return_token_ids``; llama-server: ``return_tokens``, in ``__verbose``), and must decode,
with specft's tokenizer, to the text the server wrote: a server with another model or
tokenizer fails that check at its first answer. Requests run ``concurrency`` at a time
(the server batches them), each retried with backoff on a dropped connection or a 5xx.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from specft.common.errors import SpecftError
from specft.config import AnswerServerConfig, RegenerateConfig
from specft.engines import EngineUnreachable

RETRY_STATUS = (429, 500, 502, 503, 504)


@dataclass
class ServedAnswer:
    ids: list[int]
    text: str
    finish_reason: str


class AnswerServer:
    """``AnswerServer(cfg.data.regenerate.server)``: identity() once, then answer(prompts)."""

    def __init__(self, cfg: AnswerServerConfig):
        self.cfg = cfg
        self.base = (cfg.url or "").rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[: -len("/v1")]
        self._model: str | None = cfg.model

    # -- requests ----------------------------------------------------------------------------

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key_env:
            key = os.environ.get(self.cfg.api_key_env)
            if not key:
                raise SpecftError(f"data.regenerate.server.api_key_env: ${self.cfg.api_key_env} is not set; export "
                                  "the server's API key in it, or drop api_key_env for a server without one")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _request(self, path: str, body: dict | None, timeout: float) -> dict:
        """One call, retried ``retries`` times with doubling waits on a dropped connection
        or a 429/5xx; anything else, or the last failure, is one line."""
        data = json.dumps(body).encode() if body is not None else None
        wait, failure, unreachable = 1.0, "", False
        for attempt in range(self.cfg.retries + 1):
            request = urllib.request.Request(self.base + path, data=data, headers=self._headers())
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as err:  # its body on the one line: newlines folded
                body = " ".join(err.read()[:300].decode(errors="replace").split())
                failure, unreachable = f"HTTP {err.code}: {body}", False
                if err.code not in RETRY_STATUS:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
                failure, unreachable = str(getattr(err, "reason", err)), True
            except ValueError as err:  # not JSON
                failure = f"not a JSON answer ({err})"
                break
            if attempt < self.cfg.retries:
                time.sleep(wait)
                wait *= 2
        raise (EngineUnreachable if unreachable else SpecftError)(
            f"data.regenerate.server: {self.base}{path} gave no usable answer after {self.cfg.retries + 1} tries "
            f"({failure[:300]}); is the server up at data.regenerate.server.url?")

    def identity(self) -> dict:
        """What serves the answers (part of the cache's key): the model's name, and the
        facts the server gives about it (llama-server: its vocabulary, size and parameter
        count; vLLM: its root checkpoint)."""
        listing = self._request("/v1/models", None, self.cfg.connect_timeout_s)
        models = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
            raise SpecftError(f"data.regenerate.server: {self.base}/v1/models answered no OpenAI model list: "
                              f"{json.dumps(listing)[:200]}")
        if not models:
            raise SpecftError(f"data.regenerate.server: {self.base}/v1/models lists no model")
        names = [m.get("id") for m in models]
        if self._model is None:
            self._model = names[0]
        chosen = next((m for m in models if m.get("id") == self._model), None)
        if chosen is None:
            raise SpecftError(f"data.regenerate.server.model: {self._model!r} is not served at {self.base} "
                              f"(it serves: {', '.join(map(str, names))})")
        # The model, not how it is served: a context size (vLLM's max_model_len,
        # llama-server's n_ctx) changes no complete answer, and a server restarted with a
        # larger one to answer what it cut must resume the same store.
        facts = {k: chosen[k] for k in ("root", "owned_by") if k in chosen}
        if isinstance(chosen.get("meta"), dict):
            facts["meta"] = {k: v for k, v in chosen["meta"].items() if k != "n_ctx"}
        return {"engine": "server", "model": self._model, **facts}

    def _complete(self, prompt: list[int], rc: RegenerateConfig, seed: int) -> ServedAnswer:
        # top_k 0 and min_p 0 switch off what llama-server would otherwise add (its defaults
        # are 40 and 0.05), so a sampled answer draws from the distribution specft's does
        body = {"model": self._model, "prompt": list(prompt), "max_tokens": rc.max_new_tokens,
                "temperature": rc.temperature, "top_p": rc.top_p, "top_k": rc.top_k, "min_p": 0.0,
                "seed": seed, "stream": False,
                "return_token_ids": True,  # vLLM
                # llama-server: every generated id in __verbose.tokens (its n_probs entries
                # leave out the tokens inside a multi-byte character)
                "return_tokens": True, "verbose": True}
        out = self._request("/v1/completions", body, self.cfg.timeout_s)
        try:
            choice = out["choices"][0]
        except (KeyError, IndexError, TypeError):
            choice = None
        if not isinstance(choice, dict):
            raise SpecftError(f"data.regenerate.server: {self.base}/v1/completions answered without choices: "
                              f"{json.dumps(out)[:200]}")
        text, finish = choice.get("text") or "", choice.get("finish_reason") or ""
        if not isinstance(text, str) or not isinstance(finish, str):
            raise SpecftError(f"data.regenerate.server: {self.base}/v1/completions answered a choice whose text or "
                              f"finish_reason is not a string: {json.dumps(choice)[:200]}")
        return ServedAnswer(_token_ids(out, choice, self.base), text, finish)

    def answer(self, prompts: list[list[int]], rc: RegenerateConfig, seed: int) -> list[ServedAnswer]:
        """Every prompt's answer, in order; row i sampled with seed + i."""
        if self._model is None:
            self.identity()
        with ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:
            return list(pool.map(lambda item: self._complete(item[1], rc, seed + item[0]), enumerate(prompts)))


def _token_ids(out: dict, choice: dict, base: str) -> list[int]:
    verbose = out.get("__verbose")
    ids = choice.get("token_ids")  # vLLM's return_token_ids
    if not isinstance(ids, list) and isinstance(verbose, dict):
        ids = verbose.get("tokens")  # llama-server's return_tokens
    if isinstance(ids, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise SpecftError(f"data.regenerate.server: {base} returned token ids that are not token ids: "
                              f"{json.dumps(ids)[:200]}")
        return ids
    raise SpecftError(f"data.regenerate.server: {base} returns no token ids with its answers (vLLM: "
                      "return_token_ids, llama-server: return_tokens with verbose), so they cannot be checked "
                      "against specft's tokenizer; serve with vLLM, SGLang or llama-server")


def check_tokens(answer: ServedAnswer, tokenizer, where: str) -> None:
    """The server's ids, decoded by specft's tokenizer, must give the server's text: a
    server with another model or tokenizer fails here, naming the first token that differs."""
    text = _canonical(answer.text)

    def spelled(ids) -> str:  # servers write no text for special tokens (a stop, a control token)
        return _canonical(tokenizer.decode(ids, skip_special_tokens=True))

    # an answer cut at max_new_tokens inside a multi-byte character: transformers writes
    # U+FFFD for the broken end, vLLM holds the bytes back and writes nothing
    if spelled(answer.ids).rstrip(REPLACEMENT) == text.rstrip(REPLACEMENT):
        return
    for position in range(len(answer.ids)):  # the first id whose text leaves the server's
        if not text.startswith(spelled(answer.ids[: position + 1]).rstrip(REPLACEMENT)):
            break
    else:
        position = len(answer.ids)
    raise SpecftError(f"data.regenerate.server: {where}: the server's token ids do not spell its text with specft's "
                      f"tokenizer (first at answer token {position}: id "
                      f"{answer.ids[position] if position < len(answer.ids) else '-'}"
                      f", server text {answer.text[:40]!r}); the server serves another model or tokenizer than "
                      "model.path")



REPLACEMENT = "\ufffd"


def _canonical(text: str) -> str:
    """Bytes that are not UTF-8 (a token ending mid-character) become U+FFFD, one per byte
    in transformers and one per sequence in llama-server: compare runs as one."""
    return re.sub(REPLACEMENT + "+", REPLACEMENT, text)
