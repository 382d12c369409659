"""A stand-in for the Hugging Face hub's HTTP API on 127.0.0.1, for the download tests (no network
here): the two endpoints huggingface_hub's `model_info(files_metadata=True)` and `hf_hub_download`
call, with the headers they read (X-Repo-Commit, ETag, Content-Length). The client is the real
huggingface_hub, pointed here by HF_ENDPOINT. `repos`: {"owner/name": {path in the repo: bytes}}."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.fetched: list[str] = []  # "owner/name/path" of every file body sent
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                parts = unquote(urlparse(self.path).path).strip("/").split("/")
                if parts[:2] == ["api", "models"]:  # /api/models/owner/name[/revision/rev]
                    files = hub.repos.get("/".join(parts[2:4]))
                    if files is None:
                        return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"},
                                          body)
                    info = {"id": "/".join(parts[2:4]), "sha": COMMIT,
                            "siblings": [{"rfilename": name, "size": len(data)} for name, data in files.items()]}
                    return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
                if len(parts) >= 5 and parts[2] == "resolve":  # /owner/name/resolve/rev/path
                    repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                    data = hub.repos.get(repo, {}).get(name)
                    if data is None:
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, body)
                    if body:
                        hub.fetched.append(f"{repo}/{name}")
                    return self._send(200, data, {"X-Repo-Commit": COMMIT, "Content-Type": "application/octet-stream",
                                                  "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, body)
                return self._send(404, b"", {}, body)

            def _send(self, code: int, data: bytes, headers: dict, body: bool) -> None:
                self.send_response(code)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler
