"""The run's credentials as pure functions (components/serving/auth.py, handshake.py), where they reach a server process
(its environment, never its command line), what a server found at an address gets before it proves itself (nothing),
and the passwords of URLs kept out of what is logged (a sweep's study storage in its MLflow run)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from components import handshake
from components.serving.auth import MissingSecret, new_secret, read_secret, request_headers
from components.serving.launcher import rollout_argv, rollout_probe, server_argv, triton_probe
from components.serving.rollout.client import RolloutClient
from components.serving.triton.clients import CriticClient
from components.serving.triton.contract import ServerSpec
from components.sweep.config import SweepConfig
from components.sweep.tracking import SweepRun
from components.tracking.tracker import redact
from models.config import RLHFConfig, merge
from models.resolve import pin


def test_secrets_and_the_keys_derived_from_them():
    a, b = new_secret(), new_secret()
    assert a != b and len(a) >= 43  # 256 bits, URL-safe
    ka, kb = handshake.RunKeys(a), handshake.RunKeys(b)
    assert ka.server != ka.client and ka.server != kb.server and ka.client != kb.client  # one key per use and run
    challenge = "0" * 32
    assert (ka.proof("triton", challenge) == handshake.RunKeys(a).proof("triton", challenge)
            != kb.proof("triton", challenge))
    assert ka.proof("triton", challenge) != ka.proof("rollout", challenge)  # a proof names the role it answers for
    header = request_headers(a, "POST", "/generate")["authorization"]
    assert header.startswith("RLHF-HMAC ts=") and a not in header and request_headers(a, "POST", "/generate") != \
        request_headers(a, "POST", "/generate")  # a fresh nonce each time


def test_a_signed_request_passes_once_and_nothing_else_passes():
    secret = new_secret()
    verifier = handshake.Verifier(handshake.RunKeys(secret))
    header = request_headers(secret, "POST", "/generate")["authorization"]
    assert verifier.check("POST", "/generate", header) is None
    assert verifier.check("POST", "/generate", header) == (403, "authorization: this request was sent before (a nonce "
                                                                 "is used once)")
    fresh = request_headers(secret, "POST", "/generate")["authorization"]
    assert verifier.check("POST", "/update_weights", fresh)[0] == 403  # signed for another path
    assert verifier.check("GET", "/generate", fresh)[0] == 403  # or another method
    assert verifier.check("POST", "/generate", request_headers(new_secret(), "POST", "/generate")["authorization"]) \
        == (403, "authorization: not signed with this run's key")
    assert verifier.check("POST", "/generate", fresh, now=time.time() + handshake.WINDOW_S + 5)[1].startswith(
        "authorization: ts=")  # too old
    for unsigned in (None, f"Bearer {secret}", "RLHF-HMAC ts=1, nonce=zz, mac=00"):
        status, why = verifier.check("POST", "/generate", unsigned)
        assert status == 401 and why.startswith("authorization:"), unsigned
    assert verifier.check("POST", "/generate", fresh) is None  # the untouched one still passes, once


class Impostor(BaseHTTPRequestHandler):
    """A server at the run's address that does not know the run's secret: it records every byte it is sent and
    answers each request 200 (a proof made with `secret`, when it has one)."""

    protocol_version = "HTTP/1.1"  # keeps the connection open, as a real server does
    received: list = []
    secret = None

    def do_any(self):
        length = int(self.headers.get("content-length") or 0)
        headers = {name.lower(): value for name, value in self.headers.items()}
        self.received.append((self.requestline, headers, self.rfile.read(length) if length else b""))
        proof = {}
        if self.secret and self.path == handshake.PROOF_PATH:
            proof = {handshake.PROOF_HEADER: handshake.RunKeys(self.secret).proof(headers[handshake.ROLE_HEADER],
                                                                        headers[handshake.CHALLENGE_HEADER])}
        body = b'{"weights_version": 0, "max_batch_size": 8, "output": []}'
        self.send_response(200)
        for name, value in {**proof, "content-type": "application/json", "content-length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_any

    def log_message(self, *args):
        pass


@pytest.fixture
def impostor():
    class Handler(Impostor):
        received: list = []
        secret = None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_server_that_cannot_prove_the_runs_secret_is_sent_nothing(impostor):
    """The issue's probe: a stranger's server at the address a run's client finds. Each client of the run (critic and
    reward, rollout, the probes) asks it to prove the run's secret first, and sends it nothing else: no secret, no
    key, no signed header, no payload; what it saw (a random challenge) lets it speak as the run nowhere."""
    handler, url = impostor
    secret = new_secret()
    with pytest.raises(handshake.ServerNotProven, match="did not prove it holds the run's secret"):
        RolloutClient(url, "run/1", timeout_s=10, secret=secret).generate({"prompt_token_ids": [[1, 2, 3]]})
    critic = CriticClient(url, timeout_s=10, secret=secret, combined_reward=True)
    with pytest.raises(handshake.ServerNotProven):
        critic.infer(np.ones((2, 4), np.int64), np.full((2,), 4))
    critic.close()
    for probe in (rollout_probe(url, secret=secret), triton_probe(url, ["critic_infer"], secret)):
        with pytest.raises(Exception, match="did not prove it holds the run's secret") as refused:
            probe()
        assert refused.value.reason == "wrong_server"
    assert handler.received and {line for line, _, _ in handler.received} == {f"GET {handshake.PROOF_PATH} HTTP/1.1"}
    keys = handshake.RunKeys(secret)
    for _, headers, body in handler.received:
        assert body == b"" and "authorization" not in headers
        seen = str(headers)
        assert secret not in seen and keys.client.hex() not in seen and keys.server.hex() not in seen
        assert len(headers[handshake.CHALLENGE_HEADER]) == 32
    challenges = [headers[handshake.CHALLENGE_HEADER] for _, headers, _ in handler.received]
    assert len(set(challenges)) == len(challenges)  # a fresh challenge each time: an old answer proves nothing


def test_a_server_that_proves_the_runs_secret_gets_signed_requests(impostor):
    """The same server, now holding the run's secret: the client's requests reach it, signed (a header that the
    server can check and never use twice), still without the secret."""
    handler, url = impostor
    secret = new_secret()
    handler.secret = secret
    client = RolloutClient(url, "run/1", timeout_s=10, secret=secret)
    assert client.version() == 0 and client.version() == 0
    client.close()
    signed = [(line, headers) for line, headers, _ in handler.received if not line.startswith("GET /rlhf/proof")]
    assert [line for line, _ in signed] == ["GET /health HTTP/1.1"] * 2
    assert sum(line.startswith("GET /rlhf/proof") for line, _, _ in handler.received) == 1  # one kept-alive connection
    verifier = handshake.Verifier(handshake.RunKeys(secret))
    for _, headers in signed:
        assert secret not in str(headers)
        assert verifier.check("GET", "/health", headers["authorization"]) is None
    assert verifier.check("GET", "/health", signed[0][1]["authorization"])[0] == 403  # a replay is refused


def test_a_server_without_the_proof_answer_is_refused_by_a_plain_http_client_too(impostor):
    """handshake.run_client is what every client of the run builds on: no request leaves before the proof."""
    handler, url = impostor
    with handshake.run_client(new_secret(), "triton", base_url=url, timeout=10) as client:
        with pytest.raises(handshake.ServerNotProven, match=f"{url.split('//')[1]} did not prove"):
            client.post("/v2/models/critic_train/infer", content=b"payload")
    assert all(body == b"" for _, _, body in handler.received)
    with pytest.raises(ValueError, match="role"):
        handshake.run_client(new_secret(), "critic")
    assert httpx.get(f"{url}/health").status_code == 200  # the stand-in is a working HTTP server


def test_a_server_reads_the_secret_from_its_environment_or_a_file(tmp_path):
    assert read_secret({}) is None
    assert read_secret({"RLHF_RUN_SECRET": "  0123456789abcdefXYZ\n"}) == "0123456789abcdefXYZ"
    (tmp_path / "secret").write_text("from-a-mounted-kubernetes-secret\n")
    assert read_secret({"RLHF_RUN_SECRET_FILE": str(tmp_path / "secret")}) == "from-a-mounted-kubernetes-secret"
    with pytest.raises(MissingSecret, match="at least 16 characters"):
        read_secret({"RLHF_RUN_SECRET": "short"})  # an empty or trivial secret would let anyone in
    with pytest.raises(MissingSecret, match="RLHF_RUN_SECRET_FILE: cannot read"):
        read_secret({"RLHF_RUN_SECRET_FILE": str(tmp_path / "absent")})


def test_no_secret_on_a_server_command_line(tmp_path, monkeypatch):
    secret = new_secret()
    monkeypatch.setenv("RLHF_RUN_SECRET", secret)
    cfg = pin(RLHFConfig.model_validate({"deploy": {"state_dir": str(tmp_path),
                                                    "rollout": {"python": "/usr/bin/env"}}}))
    argv = server_argv(ServerSpec(kind="critic", config=cfg)) + rollout_argv(cfg, 1234)
    keys = handshake.RunKeys(secret)
    assert not any(secret in arg or keys.client.hex() in arg or keys.server.hex() in arg for arg in argv)
    assert "access_token" not in ServerSpec.model_fields  # the spec travels on the command line: no field for it


def test_passwords_in_urls_are_redacted_at_any_depth():
    assert redact("postgresql+psycopg2://user:hunter2@db:5432/optuna") == "postgresql+psycopg2://user:***@db:5432/optuna"
    assert redact({"a": ["http://u:p%40ss@host/x", 3], "b": "no url here"}) == {"a": ["http://u:***@host/x", 3],
                                                                                 "b": "no url here"}
    assert redact("s3://bucket/prefix") == "s3://bucket/prefix" and redact("http://host:8080/x") == "http://host:8080/x"


def test_a_sweeps_storage_password_never_reaches_mlflow(tmp_path, mlflow_uri):
    config = merge(RLHFConfig(algorithm="rloo"), {"deploy.state_dir": str(tmp_path),
                                                  "deploy.tracking.uri": mlflow_uri})
    sweep = SweepConfig(name="secret-storage", space={"kl.beta": [0.01, 0.1]},
                        storage="postgresql+psycopg2://optuna:hunter2@db.internal/optuna")
    run = SweepRun.open(config, sweep)
    client = MlflowClient(mlflow_uri)
    logged = [client.download_artifacts(run.run_id, name, str(tmp_path)) for name in ("sweep.yaml", "config.yaml")]
    texts = [open(path).read() for path in logged]
    data = client.get_run(run.run_id).data
    assert "optuna:***@db.internal" in texts[0]
    assert not any("hunter2" in text for text in texts + [str(data.params), str(data.tags)])
