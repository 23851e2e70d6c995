"""Shared fixtures for component tests: a moto S3 server on a free loopback port, a sqlite MLflow store, the run
secret the servers started by hand and their clients share."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")
# one run secret for the servers these tests start by hand and the clients they build (as a user's shell would export
# it); a run (components/runs.py) makes its own and hands it over explicitly. Strangers in the tests send none.
os.environ.setdefault("RLHF_RUN_SECRET", "tests-" + uuid.uuid4().hex)

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """URL of a moto S3 server subprocess, killed at the end of the session."""
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    if exe is None:
        pytest.fail("moto_server not found: install the test extra (moto[server])")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"moto_server exited with {proc.returncode}")
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not answer at {url}")
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Dummy credentials; no endpoint or profile leaking in from the developer's shell."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "MLFLOW_S3_ENDPOINT_URL", "AWS_PROFILE",
                 "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    return dict(AWS_ENV)


@pytest.fixture
def s3_bucket(moto_endpoint: str, aws_env: dict[str, str]) -> tuple[str, str]:
    """(endpoint, bucket): a fresh bucket on the moto server."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return moto_endpoint, name


@pytest.fixture(scope="session")
def mlflow_store_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty sqlite MLflow store, its tables made: what a store's first use does (MLflow's migrations, ~3 s of CPU),
    done once; each test's store starts as a copy of it."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mlflow_store_template: Path) -> str:
    """A real sqlite-backed MLflow store inside tmp_path (a copy of the session's empty store)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    shutil.copyfile(mlflow_store_template, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"
