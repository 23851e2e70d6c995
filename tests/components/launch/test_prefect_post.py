"""components/launch/stack.prefect_post against a real HTTP server on loopback that answers as a busy Prefect server
does (503 while its database is locked), then as a well one."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from components.launch import stack


@pytest.fixture
def busy_server():
    """A server whose first `busy` writes answer 503 (Retry-After: 0); every request is recorded."""
    seen: list[tuple[str, str, dict, bytes]] = []
    state = {"busy": 2}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, status: int, body: dict, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            for key, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                               **(headers or {})}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            seen.append(("GET", self.path, dict(self.headers), b""))
            self.answer(200, {"token": "t-" + self.path.rsplit("=", 1)[1]})

        def do_PATCH(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(("PATCH", self.path, dict(self.headers), body))
            if state["busy"] > 0:
                state["busy"] -= 1
                return self.answer(503, {"detail": "database is locked"}, {"Retry-After": "0"})
            self.answer(204 if body else 400, {})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/api", seen, state
    finally:
        server.shutdown()
        server.server_close()


def test_a_busy_server_is_asked_again_with_a_fresh_token_until_it_answers(busy_server):
    api, seen, _ = busy_server
    answer = stack.prefect_post(api, "/deployments/d1", {"parameters": {"a": 1}}, method="PATCH")
    assert answer.status_code == 204
    patches = [(path, headers, body) for method, path, headers, body in seen if method == "PATCH"]
    assert len(patches) == 3 and all(json.loads(body) == {"parameters": {"a": 1}} for _, _, body in patches)
    for _, headers, _ in patches:  # each try with the token issued to its own client id
        assert headers["Prefect-Csrf-Token"] == "t-" + headers["Prefect-Csrf-Client"]
    assert len({headers["Prefect-Csrf-Client"] for _, headers, _ in patches}) == 3


def test_a_server_busy_beyond_the_retries_gives_its_last_answer(busy_server):
    api, seen, state = busy_server
    state["busy"] = 10
    answer = stack.prefect_post(api, "/deployments/d1", {"parameters": {}}, method="PATCH", retries=2)
    assert answer.status_code == 503 and answer.json() == {"detail": "database is locked"}
    assert sum(1 for method, *_ in seen if method == "PATCH") == 3
