"""The torch.distributed group the `dist` weight transfer runs over (the actor's rank 0 and the engine's workers), for
both its sides: the actor's rank 0 (client.py, the project's environment) and the rollout server (weights.py,
.venv-vllm). Runs in either environment: imports torch and models/rendezvous.py only (components/serving/rollout/
__init__.py).

Who may join: only a process that holds the run's secret. The trainer's store listens on the trainer's address alone,
its keys and values are the run's (models/rendezvous.SignedStore), and once the group has formed every member proves
the secret (models/rendezvous.prove) before the first tensor is sent. Every update's tensors are then checked
against the sha256 digests (`tensor_digest`) the trainer sends on the authenticated HTTP channel."""

from __future__ import annotations

import datetime
import hashlib
import os
from pathlib import Path

import torch

from models.rendezvous import open_store, prove

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
SECRET_ENV, SECRET_FILE_ENV = "RLHF_RUN_SECRET", "RLHF_RUN_SECRET_FILE"  # as components/serving/auth.py
GROUP_NAME = "weight transfer"


def read_secret(env=os.environ) -> str | None:
    """The run's secret from $RLHF_RUN_SECRET or the file $RLHF_RUN_SECRET_FILE names (as components/serving/auth.py):
    the rollout server's copy of it; None when neither is set."""
    value = env.get(SECRET_ENV)
    if value is None and env.get(SECRET_FILE_ENV):
        value = Path(env[SECRET_FILE_ENV]).read_text()
    return value.strip() if value is not None else None


def join(backend: str, host: str, port: int, rank: int, size: int, secret: str, device: torch.device,
         timeout: datetime.timedelta, connect: datetime.timedelta | None = None, store=None):
    """The group of `size` with this process as `rank` (its tensors on `device`), admitted by the run's `secret`:
    through the store at host:port (`store`: the trainer's own, which it opened as master; else joined within
    `connect`), then every member's proof. Returns (group, store)."""
    if store is None:
        store, _ = open_store(host, port, size, False, secret, connect or timeout)
        store.set_timeout(timeout)
    group = process_group(backend, store, rank, timeout, host, size)
    prove(group, rank, size, secret, device, GROUP_NAME)
    return group, store


def process_group(backend: str, store, rank: int, timeout: datetime.timedelta, peer: str = "", size: int = 2):
    """A torch.distributed group of `size` over `store`, without a default process group: gloo (its sockets on
    loopback when `peer`, the other side's address, is this machine), or NCCL (GPUs)."""
    if backend == "nccl":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(store, rank, size, options)
    Gloo = torch.distributed.ProcessGroupGloo
    options = Gloo._Options()
    options._timeout = timeout
    options._devices = [Gloo.create_device(hostname="127.0.0.1") if peer in LOOPBACK else Gloo.create_default_device()]
    return Gloo(store, rank, size, options)


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (contiguous, in its dtype), hex: what the trainer sent and the server received."""
    data = tensor.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(data.view(torch.uint8).numpy() if data.numel() else b"").hexdigest()
