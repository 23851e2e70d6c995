"""The run's credentials as pure functions (components/serving/auth.py), where they reach a server process (its
environment, never its command line), and the passwords of URLs kept out of what is logged (a sweep's study storage
in its MLflow run)."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from components.serving.auth import (MissingSecret, bearer_headers, matches, new_secret, read_secret, triton_headers,
                                     triton_token)
from components.serving.launcher import rollout_argv, server_argv
from components.serving.triton.contract import ServerSpec
from components.sweep.config import SweepConfig
from components.sweep.tracking import SweepRun
from components.tracking.tracker import redact
from models.config import RLHFConfig, merge
from models.resolve import pin


def test_secrets_and_the_tokens_derived_from_them():
    a, b = new_secret(), new_secret()
    assert a != b and len(a) >= 43  # 256 bits, URL-safe
    assert triton_token(a) == triton_token(a) != triton_token(b)
    assert a not in triton_token(a)  # what Triton's command line holds is not the run's secret
    assert triton_headers(a) == {"triton-access-token": triton_token(a)} and triton_headers(None) == {}
    assert bearer_headers(a) == {"authorization": f"Bearer {a}"} and bearer_headers(None) == {}
    assert matches(a, a) and not matches(a[:-1] + "x", a) and not matches(None, a) and not matches("", a)


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
    cfg = pin(RLHFConfig.model_validate({"deploy": {"state_dir": str(tmp_path), "rollout": {"python": "/usr/bin/env"}}}))
    argv = server_argv(ServerSpec(kind="critic", config=cfg)) + rollout_argv(cfg, 1234)
    assert not any(secret in arg or triton_token(secret) in arg for arg in argv)
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
