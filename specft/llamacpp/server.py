"""llama-server started on 127.0.0.1 for one job and always stopped: greedy completions of
token-id prompts, with the engine's own draft counters and timings."""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specft.common.errors import SpecftError
from specft.llamacpp.install import binary

# A hang bound only: the wait ends the moment /health answers or the process exits, and a
# model load on a machine busy with other jobs must never reach it.
STARTUP_TIMEOUT_S = 1800.0


@dataclass
class ServerOptions:
    target: Path
    draft: Path | None = None
    spec_type: str = "draft-eagle3"
    draft_n: int = 3  # --spec-draft-n-max: the draft length k
    slots: int = 1  # -np: parallel sequences (continuous batching)
    threads: int | None = None
    ctx_per_slot: int = 2048
    # --spec-draft-p-min: 0 drafts k tokens every round; above, the round stops at a less confident one
    p_min: float = 0.0
    extra: list[str] = field(default_factory=list)

    def args(self, port: int) -> list[str]:
        args = [str(binary("llama-server")), "-m", str(self.target), "--host", "127.0.0.1", "--port", str(port),
                "-np", str(self.slots), "-c", str(self.ctx_per_slot * self.slots), "--no-webui",
                "--cache-ram", "0"]
        if self.threads:
            args += ["-t", str(self.threads), "-tb", str(self.threads)]
        if self.draft is not None or self.spec_type.startswith("ngram"):
            # by default k drafted tokens every round (no early stop on draft confidence), as
            # specft eval counts; the ngram types draft from the context itself, with no draft model
            model = ["-md", str(self.draft)] if self.draft is not None else []
            args += [*model, "--spec-type", self.spec_type, "--spec-draft-n-max", str(self.draft_n),
                     "--spec-draft-n-min", "0", "--spec-draft-p-min", str(self.p_min)]
        return args + self.extra


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """``with LlamaServer(options) as server: server.complete(ids, 64)``."""

    def __init__(self, options: ServerOptions, startup_timeout_s: float = STARTUP_TIMEOUT_S):
        self.options, self.startup_timeout_s = options, startup_timeout_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)

    def __enter__(self) -> LlamaServer:
        self.process = subprocess.Popen(self.options.args(self.port), stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, lines: int = 5) -> str:
        text = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:])

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SpecftError(f"llama-server exited with code {self.process.returncode} while starting "
                                  f"({self.log_tail()}; log: {self.log.name})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise SpecftError(f"llama-server did not come up within {self.startup_timeout_s:.0f} s on {self.url} "
                          f"(log: {self.log.name})")

    def post(self, path: str, body: dict, timeout: float = 3600.0) -> dict:  # a hang bound
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:
            raise SpecftError(f"llama-server {path}: HTTP {err.code}: {err.read()[:300]!r}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            raise SpecftError(f"llama-server {path}: no answer ({err}; {self.log_tail(3)})") from None

    def complete(self, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> dict:
        """Greedy continuation of a token-id prompt: {tokens, timings (with draft_n and
        draft_n_accepted when a draft ran)}."""
        body = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
                "samplers": ["top_k"], "cache_prompt": False, "return_tokens": True,
                "ignore_eos": not stop_at_eos, "seed": 0}
        out = self.post("/completion", body)
        return {"tokens": list(out.get("tokens") or []), "timings": out.get("timings") or {}}
