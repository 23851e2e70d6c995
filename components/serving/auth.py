"""Per-run credentials of a run's servers: one secret per run, known to the run and its servers only, and never sent.

Whoever starts a run's servers generates the run's secret (`new_secret`: components/serving/services.run_secret,
once per run attempt) and hands it to each server through its environment ($RLHF_RUN_SECRET), or a file named by
$RLHF_RUN_SECRET_FILE (a Kubernetes Secret of the run, mounted into its server pods, deleted with them). It never
appears on a command line, in a log, in a pod's spec, in Prefect (parameters, blocks, variables) or in MLflow.

On the wire (components/handshake.py) the secret never crosses either: a server proves it holds it before a client
sends anything on a new connection (GET /rlhf/proof answers the client's fresh challenge with an HMAC), and every
request is signed with a key derived from it (`Authorization: RLHF-HMAC ...`, each nonce once). A server found at an
address that cannot prove itself is sent nothing.

How each server checks it:
- critic and reward servers (PyTriton): the server's address is its front (components/serving/triton/front.py), which
  checks the signature; Triton listens on a Unix socket in the server's private workspace with no token on its
  command line, so no other user of the machine reaches it. Liveness and readiness (`/v2/health/*`,
  `/v2/models/<m>/ready`) stay open: a probe needs no secret. Triton's admin APIs (model loading, the repository,
  shared memory, trace, logging) are closed to every caller. Open mode (`deploy.critic.auth: none` /
  `deploy.reward.auth: none`) serves inference, model config and metadata to a client that sends no credentials
  (NeMo-Aligner's), and the server says so when it starts.
- the rollout server (FastAPI): the same signature on every endpoint but GET /health and the proof, 401 unsigned,
  403 signed otherwise (components/serving/rollout/app.py's Guard).

The actor's ranks (and a critic server's) prove the same kind of secret to each other when they form their group
(models/rendezvous.py): `ranks_secret` is the run's from the environment (on several nodes the controller's, handed
to every node group: a JobSet's pods get it as a mounted Secret), else a fresh one that rank 0 hands to the ranks it
starts in their environment. The rollout server's weight-transfer group is admitted by the run's secret too.

What is logged has the passwords of URLs taken out (components/tracking/tracker.redact).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Mapping, Optional

from components import handshake

SECRET_ENV = "RLHF_RUN_SECRET"  # the run's secret, in a server's environment
SECRET_FILE_ENV = "RLHF_RUN_SECRET_FILE"  # or a file holding it (a Kubernetes Secret mounted as a volume)


class MissingSecret(RuntimeError):
    """A server that must check the run's secret was started without one."""


def new_secret() -> str:
    """A fresh run secret: 256 random bits, URL-safe (a header value, an environment variable)."""
    return secrets.token_urlsafe(32)


def request_headers(secret: str, method: str, path: str) -> dict[str, str]:
    """The header that signs one request to a run's server (`path` without its query): fresh each time, used once."""
    return handshake.request_headers(handshake.RunKeys(secret), method, path)


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
