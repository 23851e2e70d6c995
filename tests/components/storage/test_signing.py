"""Where a store's signing key comes from, what a signature binds (components/storage/signing.py), and the run's own
S3 credentials a run store's requests carry (components/storage/s3.py tagged_session) against a real STS and S3
endpoint (moto's server, behind a recording proxy that passes every request on)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from components.storage import signing
from components.storage.signing import KEY_ARN_ENV, KEY_ENV, KEY_FILE_ENV, Signer, StoreKeyError, store_key
from components.storage.store import CheckpointStore
from tests.components.storage.test_checkpoints import FAST, REPO, make_parts
from tests.s3_proxy import s3_proxy

KEY = "k" * 40


@pytest.fixture
def no_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An environment with no store key set and a config home of its own (returned)."""
    for name in (KEY_ENV, KEY_FILE_ENV, KEY_ARN_ENV, "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config"


@FAST
def test_the_store_key_comes_from_the_environment_or_a_file(no_key: Path, tmp_path: Path) -> None:
    assert store_key({KEY_ENV: f"  {KEY}\n"}) == KEY.encode()
    (tmp_path / "key").write_text(KEY + "\n")
    assert store_key({KEY_FILE_ENV: str(tmp_path / "key")}) == KEY.encode()
    assert store_key({KEY_ENV: KEY, KEY_FILE_ENV: str(tmp_path / "absent")}) == KEY.encode()  # the first source wins
    assert not no_key.exists()  # no key file made when one is given


def test_the_store_key_comes_from_an_aws_secrets_manager_secret(no_key: Path, moto_endpoint: str, aws_env,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_SECRETS_MANAGER", moto_endpoint)
    arn = boto3.client("secretsmanager").create_secret(Name=f"store-key-{os.getpid()}-{id(no_key)}",
                                                       SecretString=KEY)["ARN"]
    signing._aws_secret.cache_clear()
    assert store_key({KEY_ARN_ENV: arn}) == KEY.encode()
    with pytest.raises(StoreKeyError, match=rf"\${KEY_ARN_ENV}: cannot read the store key .*'no-such-secret'"):
        store_key({KEY_ARN_ENV: "no-such-secret"})


@FAST
def test_a_users_key_file_is_made_once_private_and_shared_by_its_processes(no_key: Path) -> None:
    """No key given: the first process makes ~/.config/rlhf-flows/store.key (0600, in a 0700 directory); two
    processes making it at once end up with the same key, and later calls read it."""
    script = ("import hashlib, sys\nfrom components.storage.signing import store_key\n"
              "print(hashlib.sha256(store_key()).hexdigest())")
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CONFIG_HOME": str(no_key)}
    for name in (KEY_ENV, KEY_FILE_ENV, KEY_ARN_ENV):
        env.pop(name, None)
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    digests = {proc.communicate(timeout=60)[0].strip() for proc in procs}
    path = no_key / "rlhf-flows" / "store.key"
    assert len(digests) == 1 and digests == {hashlib.sha256(store_key()).hexdigest()}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(path.read_text().strip()) >= signing.MIN_KEY_CHARS
    assert [p.name for p in path.parent.iterdir()] == ["store.key"]  # no temporary file left


@FAST
def test_a_pod_without_a_store_key_is_refused_naming_where_to_give_it(no_key: Path) -> None:
    with pytest.raises(StoreKeyError, match=rf"no store key: set \${KEY_ARN_ENV} .* in a pod"):
        store_key({"XDG_CONFIG_HOME": str(no_key), "KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert not no_key.exists()


@FAST
def test_a_short_or_unreadable_key_is_refused_naming_its_source(tmp_path: Path) -> None:
    with pytest.raises(StoreKeyError, match=rf"\${KEY_ENV}: the store key must have at least 32 characters, got 5"):
        store_key({KEY_ENV: "short"})
    with pytest.raises(StoreKeyError, match=rf"\${KEY_FILE_ENV}: cannot read {re.escape(str(tmp_path))}/absent"):
        store_key({KEY_FILE_ENV: str(tmp_path / "absent")})


@FAST
def test_a_signature_binds_the_records_content_the_stores_name_and_the_key() -> None:
    record = {"seq": 3, "fence": "t", "checkpoints": [{"iteration": 1, "path": "iter_1-0-0a1b2c3d"}], "x": 1e-5}
    signed = Signer(KEY.encode(), "run-a").sign(record)
    relaid = json.loads(json.dumps(signed, indent=4))  # another layout of the same JSON
    assert Signer(KEY.encode(), "run-a").verify(relaid) is None
    assert Signer(KEY.encode(), "run-a").verify({**signed, "seq": 4}) == "its signature does not match its content"
    assert Signer(KEY.encode(), "run-b").verify(signed) == "its signature does not match its content"
    assert Signer(("x" * 40).encode(), "run-a").verify(signed) == "its signature does not match its content"
    assert Signer(KEY.encode(), "run-a").verify(record) == "it carries no signature"
    assert Signer(KEY.encode(), "run-a").verify([signed]) == "it is not a JSON object but list"


# ------------------------------------------------------------------------------------------- a run's S3 credentials
@pytest.fixture
def recorded(s3_bucket):
    """(endpoint, bucket, requests seen): a recording proxy in front of moto's server."""
    seen: list = []
    with s3_proxy(s3_bucket[0], seen) as endpoint:
        yield endpoint, s3_bucket[1], seen


def test_a_run_stores_requests_carry_its_run_tagged_credentials_under_irsa(recorded, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """In a pod with IRSA, a run's store assumes the pod's role again with the session tag run=<run name> and signs
    every S3 request with those credentials; without IRSA it uses the process's credentials as they are."""
    endpoint, bucket, seen = recorded
    role = "arn:aws:iam::123456789012:role/dev-actor-pod"
    (tmp_path / "token").write_text("a web identity token")
    monkeypatch.setenv("AWS_ROLE_ARN", role)
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "token"))
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", endpoint)
    store = CheckpointStore.from_uri(f"s3://{bucket}/rlhf/checkpoints/exp-tag", s3_endpoint_url=endpoint)
    store.fence("lease")
    store.save(1, make_parts(tmp_path / "a", 1, big=10), {"step": 1}, fence="lease")

    assumed = [(body.decode(), answer.decode()) for method, _, _, body, answer in seen if b"Action=AssumeRole" in body]
    assert len(assumed) == 1, assumed  # once: botocore renews it only near its expiry
    request, answer = assumed[0]
    assert f"RoleArn={role.replace(':', '%3A').replace('/', '%2F')}" in request
    assert "RoleSessionName=rlhf-exp-tag" in request
    assert "Tags.member.1.Key=run" in request and "Tags.member.1.Value=exp-tag" in request
    key_id = re.search(r"<AccessKeyId>([^<]+)</AccessKeyId>", answer).group(1)
    s3_requests = [headers for method, path, headers, body, _ in seen if path.startswith(f"/{bucket}")]
    assert s3_requests and all(f"Credential={key_id}/" in h["Authorization"] for h in s3_requests)

    seen.clear()
    monkeypatch.delenv("AWS_WEB_IDENTITY_TOKEN_FILE")  # no IRSA: the process's own credentials
    CheckpointStore.from_uri(f"s3://{bucket}/rlhf/checkpoints/exp-tag", s3_endpoint_url=endpoint).list()
    assert not [body for *_, body, _ in seen if b"AssumeRole" in body]
    assert all("Credential=testing/" in h["Authorization"] for _, path, h, *_ in seen if path.startswith(f"/{bucket}"))


def test_a_run_store_that_cannot_get_its_run_credentials_fails_naming_the_role_and_tag(s3_bucket, tmp_path: Path,
                                                                                     monkeypatch: pytest.MonkeyPatch):
    endpoint, bucket = s3_bucket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"  # nobody listens there once the block ends
    (tmp_path / "token").write_text("a web identity token")
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/dev-actor-pod")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "token"))
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", closed)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(PermissionError, match=r"run exp-x: cannot get its S3 credentials, sts:AssumeRole of "
                                              r"arn:aws:iam::123456789012:role/dev-actor-pod with the session tag "
                                              r"run=exp-x failed"):
        CheckpointStore.from_uri(f"s3://{bucket}/rlhf/checkpoints/exp-x", s3_endpoint_url=endpoint)
