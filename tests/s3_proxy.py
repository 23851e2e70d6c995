"""An HTTP proxy in front of moto's S3 server, for tests that must see or change what a run's S3 client sends:
every request is passed on to `upstream` and recorded in `seen` as (method, path, headers, body, answer), except a
read (GET/HEAD) whose path matches `forbidden`, which is answered 403 AccessDenied as S3 answers it."""

from __future__ import annotations

import contextlib
import http.client
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, Optional
from urllib.parse import urlparse

ACCESS_DENIED = b'<?xml version="1.0"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'


class _Proxy(BaseHTTPRequestHandler):
    upstream: str
    seen: list
    forbidden: Optional[re.Pattern] = None

    def _handle(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.forbidden is not None and self.forbidden.search(self.path) and self.command in ("GET", "HEAD"):
            self.send_response(403)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(ACCESS_DENIED) if self.command == "GET" else 0))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(ACCESS_DENIED)
            return
        target = urlparse(self.upstream)
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
        conn.request(self.command, self.path, body=body or None, headers=dict(self.headers.items()))
        response = conn.getresponse()
        data = response.read()
        self.seen.append((self.command, self.path, dict(self.headers.items()), body, data))
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def s3_proxy(upstream: str, seen: Optional[list] = None, forbidden: Optional[str] = None) -> Iterator[str]:
    """The proxy's endpoint URL while the block runs (module docstring); `seen` collects what passed."""
    handler = type("Handler", (_Proxy,), {"upstream": upstream, "seen": seen if seen is not None else [],
                                          "forbidden": re.compile(forbidden) if forbidden else None})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
