"""The signatures of a checkpoint store's records (components/storage/store.py): `latest.json` and every checkpoint's
`state.json` carry an HMAC-SHA256 over their content, with a key the bucket does not reveal, checked whenever a
store reads them (a resume, an export, a critic restoring its part). A record without a valid signature is refused,
naming it: never resumed, never a fallback.

The key of a store is derived from the deployment's store key and the store's name (its URI's last segment: a run's
name), so a record signed for one run never verifies in another's store:

    run key = HMAC-SHA256(store key, "rlhf-flows checkpoint store v1\\0" + name)

The store key is a secret of the deployment, never in the bucket, the config, a command line or a log; the first of:
- $RLHF_STORE_KEY: the key itself (a Kubernetes Secret's value through a secretKeyRef: deploy.cluster.secret_env);
- $RLHF_STORE_KEY_FILE: a file holding it (a mounted Secret);
- $RLHF_STORE_SIGNER_ARN: an AWS Secrets Manager secret (its ARN or name) holding it, read with the process's own AWS
  credentials: what infra/terraform makes (terraform output store_key_secret_arn) and gives every pod of the
  cluster, whose roles alone may read it;
- else this user's key file, $XDG_CONFIG_HOME/rlhf-flows/store.key (~/.config/...), made on first use (mode 0600):
  every run of this user on this machine shares it, as its processes share the machine. Not inside a Kubernetes pod:
  a pod's home is gone with it, and the next attempt of the run (a new pod) could not check what the last one signed.
At least 32 characters (the file made here: 256 random bits). Rotating it makes every existing store refuse to
resume (its records are signed with the old key): rotate between runs.

Why a deployment key and not one per run kept in the bucket: the bucket would reveal it to whoever can read it, and a
run reads other runs' stores (a pipeline's stage reads its upstream stage's model). Other runs of the same deployment
hold the store key too; what keeps them out of a run's store is IAM (infra/terraform/modules/iam: a run's
credentials write only its own prefix), what keeps anyone else's commit from being resumed is this signature.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Mapping

import boto3
from botocore.exceptions import BotoCoreError, ClientError

KEY_ENV = "RLHF_STORE_KEY"
KEY_FILE_ENV = "RLHF_STORE_KEY_FILE"
KEY_ARN_ENV = "RLHF_STORE_SIGNER_ARN"  # not a secret: where it is (a name with KEY or SECRET is refused in pod specs)
MIN_KEY_CHARS = 32
MAC = "mac"  # the field of a signed record that holds its signature
_CONTEXT = b"rlhf-flows checkpoint store v1\0"


class StoreKeyError(RuntimeError):
    """The deployment's store key cannot be found, read or made."""


def default_key_file(env: Mapping[str, str] = os.environ) -> Path:
    """This user's store key: $XDG_CONFIG_HOME/rlhf-flows/store.key, ~/.config/rlhf-flows/store.key by default."""
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "rlhf-flows" / "store.key"


def store_key(env: Mapping[str, str] = os.environ) -> bytes:
    """The deployment's store key, from the first source the module docstring lists."""
    if env.get(KEY_ENV) is not None:
        return _checked(env[KEY_ENV], f"${KEY_ENV}")
    if env.get(KEY_FILE_ENV):
        path = Path(env[KEY_FILE_ENV])
        try:
            return _checked(path.read_text(), f"${KEY_FILE_ENV} ({path})")
        except OSError as exc:
            raise StoreKeyError(f"${KEY_FILE_ENV}: cannot read {path}: {exc.strerror or exc}") from None
    if env.get(KEY_ARN_ENV):
        return _checked(_aws_secret(env[KEY_ARN_ENV]), f"${KEY_ARN_ENV} ({env[KEY_ARN_ENV]})")
    path = default_key_file(env)
    if not path.exists() and env.get("KUBERNETES_SERVICE_HOST"):
        raise StoreKeyError(f"no store key: set ${KEY_ARN_ENV} (terraform output store_key_secret_arn), "
                            f"${KEY_FILE_ENV} or ${KEY_ENV} (a Kubernetes Secret); in a pod, {path} would be gone "
                            f"with it, and the run's next attempt could not check what this one signs")
    return _checked(_made(path), str(path))


def _checked(value: str, where: str) -> bytes:
    value = value.strip()
    if len(value) < MIN_KEY_CHARS:
        raise StoreKeyError(f"{where}: the store key must have at least {MIN_KEY_CHARS} characters, got {len(value)}")
    return value.encode()


@functools.lru_cache(maxsize=None)
def _aws_secret(secret_id: str) -> str:
    """The value of an AWS Secrets Manager secret (read once per process)."""
    try:
        return boto3.client("secretsmanager").get_secret_value(SecretId=secret_id)["SecretString"]
    except (BotoCoreError, ClientError, KeyError) as exc:
        raise StoreKeyError(f"${KEY_ARN_ENV}: cannot read the store key from AWS Secrets Manager secret "
                            f"{secret_id!r}: {exc}") from None


def _made(path: Path) -> str:
    """The key in `path`, made there (mode 0600, in a directory of mode 0700) when there is none: written beside it and
    linked into place, so of two processes making it at once both end up with the one that was linked first."""
    try:
        return path.read_text()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StoreKeyError(f"cannot read the store key {path}: {exc.strerror or exc}") from None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        return path.read_text()
    except OSError as exc:
        raise StoreKeyError(f"cannot make the store key {path}: {exc.strerror or exc} (set ${KEY_FILE_ENV} to a "
                            f"key file of this deployment)") from None


def canonical(record: dict) -> bytes:
    """The bytes a record's signature covers: its JSON without the signature, keys sorted, no whitespace (so the
    layout a record was written in never matters)."""
    return json.dumps({k: v for k, v in record.items() if k != MAC}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True, allow_nan=True).encode()


class Signer:
    """Signs and checks the records of the store named `name` with the key derived for it from the store key."""

    def __init__(self, key: bytes, name: str) -> None:
        self._key = hmac.new(key, _CONTEXT + name.encode(), hashlib.sha256).digest()

    def sign(self, record: dict) -> dict:
        """`record` with its signature (the field `mac`)."""
        return {**record, MAC: hmac.new(self._key, canonical(record), hashlib.sha256).hexdigest()}

    def verify(self, record: object) -> str | None:
        """Why `record` is not one this store signed (a reason), None when its signature holds."""
        if not isinstance(record, dict):
            return f"it is not a JSON object but {type(record).__name__}"
        given = record.get(MAC)
        if not isinstance(given, str):
            return "it carries no signature"
        expected = hmac.new(self._key, canonical(record), hashlib.sha256).hexdigest()
        return None if hmac.compare_digest(given, expected) else "its signature does not match its content"
