"""Per-run credentials of a run's servers: one secret per run, known to the run and its servers only.

Whoever starts a run's servers generates the run's secret (`new_secret`: components/serving/services.run_secret,
once per run attempt) and hands it to each server through its environment ($RLHF_RUN_SECRET), or a file named by
$RLHF_RUN_SECRET_FILE (a Kubernetes Secret of the run, mounted into its server pods, deleted with them). It never
appears on a command line, in a log, in a pod's spec, in Prefect (parameters, blocks, variables) or in MLflow.

How each server checks it:
- critic and reward servers (PyTriton): Triton's restricted API groups (`--http-restricted-api`) cover every group
  but `health` (inference, model-config, metadata, and the admin groups: model-repository, statistics, trace,
  logging, shared-memory); the header Triton expects is `triton-access-token: <triton_token(secret)>`. The token is
  derived from the secret (HMAC-SHA256), because Triton takes it on its own command line (the only way it takes it):
  whoever reads that process's argv learns a token for the Triton servers of this run only, not the run's secret.
  Triton compares the header itself (its code, not ours). Liveness and readiness (`/v2/health/*`,
  `/v2/models/<m>/ready`) stay open: a probe needs no secret. Open mode (`deploy.critic.auth: none` /
  `deploy.reward.auth: none`) leaves inference, model config and metadata open for a client that sends no credentials
  (NeMo-Aligner's); the admin groups stay restricted, and the server says so when it starts.
- the rollout server (FastAPI): `Authorization: Bearer <secret>` on every endpoint but GET /health, compared in
  constant time (hmac.compare_digest), 401 without it, 403 with a wrong one (components/serving/rollout/
  app.py, which imports nothing from the project and keeps its own copy of the check).

The actor's ranks (and a critic server's) prove the same kind of secret to each other when they form their group
(models/rendezvous.py): `ranks_secret` is the run's from the environment (on several nodes the controller's, handed
to every node group: a JobSet's pods get it as a mounted Secret), else a fresh one that rank 0 hands to the ranks it
starts in their environment. The rollout server's weight-transfer group is admitted by the run's secret too.

What is logged has the passwords of URLs taken out (components/tracking/tracker.redact).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Mapping, Optional

SECRET_ENV = "RLHF_RUN_SECRET"  # the run's secret, in a server's environment
SECRET_FILE_ENV = "RLHF_RUN_SECRET_FILE"  # or a file holding it (a Kubernetes Secret mounted as a volume)
TRITON_HEADER = "triton-access-token"  # the header Triton's restricted APIs check (PyTriton's TRITON_ACCESS_HEADER)
BEARER = "Bearer"  # the rollout server's scheme: `Authorization: Bearer <secret>`, as vLLM's --api-key
# Triton API groups a run's critic/reward server restricts: every group Triton has but `health` (liveness/readiness)
RESTRICTED_APIS = ("inference", "model-config", "metadata", "shared-memory", "model-repository", "statistics", "trace",
                   "logging")
OPEN_MODE_APIS = ("shared-memory", "model-repository", "statistics", "trace", "logging")  # PyTriton's own default
_TRITON_CONTEXT = b"rlhf-flows triton access token v1"


class MissingSecret(RuntimeError):
    """A server that must check the run's secret was started without one."""


def new_secret() -> str:
    """A fresh run secret: 256 random bits, URL-safe (a header value, an environment variable)."""
    return secrets.token_urlsafe(32)


def triton_token(secret: str) -> str:
    """The token a run's Triton servers check (`triton-access-token`), derived from the run's secret."""
    return hmac.new(secret.encode(), _TRITON_CONTEXT, hashlib.sha256).hexdigest()


def triton_headers(secret: Optional[str]) -> dict[str, str]:
    """The header a request to a run's Triton server carries ({} without a secret)."""
    return {TRITON_HEADER: triton_token(secret)} if secret else {}


def bearer_headers(secret: Optional[str]) -> dict[str, str]:
    """The header a request to a run's rollout server carries ({} without a secret)."""
    return {"authorization": f"{BEARER} {secret}"} if secret else {}


def read_secret(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The run's secret from $RLHF_RUN_SECRET, else from the file $RLHF_RUN_SECRET_FILE names; None when neither is
    set. An empty value or file is refused (it would let anyone in)."""
    value = env.get(SECRET_ENV)
    if value is None and env.get(SECRET_FILE_ENV):
        path = Path(env[SECRET_FILE_ENV])
        try:
            value = path.read_text()
        except OSError as exc:
            raise MissingSecret(f"${SECRET_FILE_ENV}: cannot read {path}: {exc.strerror or exc}") from None
    if value is None:
        return None
    value = value.strip()
    if len(value) < 16:
        raise MissingSecret(f"${SECRET_ENV}: the run's secret must have at least 16 characters, got {len(value)}")
    return value


def ranks_secret() -> str:
    """The secret a group of ranks proves (see the module's docstring): this process's run secret, else a new one."""
    return read_secret() or new_secret()


def secret_env(secret: str) -> dict[str, str]:
    """The environment entry that hands a server the run's secret."""
    return {SECRET_ENV: secret}


def matches(given: Optional[str], expected: str) -> bool:
    """Whether a presented credential is the expected one, compared in constant time."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())
