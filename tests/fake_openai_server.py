"""A local OpenAI-compatible server whose replies a test writes: what regeneration reads
from a real server (vLLM, llama-server), made wrong on purpose."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# (path, request body or None) -> (HTTP status, reply bytes)
Reply = Callable[[str, dict | None], tuple[int, bytes]]


def models_listing(model: str = "fake") -> bytes:
    return json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]}).encode()


def completion(text: str, token_ids: list[int] | None, finish_reason: str = "stop") -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return json.dumps({"object": "text_completion", "choices": [choice]}).encode()


class FakeOpenAiServer:
    """``with FakeOpenAiServer(reply) as server: server.url``; ``reply`` answers every
    request (GET /v1/models and POST /v1/completions alike)."""

    def __init__(self, reply: Reply):
        reply_fn = reply

        class Handler(BaseHTTPRequestHandler):
            def _send(self, body: dict | None):
                status, data = reply_fn(self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802 (http.server's name)
                self._send(None)

            def do_POST(self):  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw or b"null")
                except ValueError:
                    body = None
                self._send(body)

            def log_message(self, *args):  # quiet: the test reads specft's output
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> FakeOpenAiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
