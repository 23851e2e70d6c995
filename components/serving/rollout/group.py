"""The torch.distributed group the `dist` weight transfer runs over (the actor's rank 0 and the engine's workers), for
both its sides: the actor's rank 0
(client.py, the project's environment) and the rollout server (weights.py, .venv-vllm). Runs in either environment:
imports torch only (components/serving/rollout/__init__.py)."""

from __future__ import annotations

import datetime

import torch

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


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
