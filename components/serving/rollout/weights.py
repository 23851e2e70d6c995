"""The `dist` weight transfer of the rollout server (`rollout.vllm.weight_transfer`): vLLM's own weight-transfer API
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`) with a backend of
ours registered in its factory: a torch.distributed group (gloo on CPU, NCCL where the engine is on a GPU) of actor
rank 0 and the engine's workers (one per tensor-parallel shard), which rank 0 broadcasts the tensors to one at a time;
each is loaded as it arrives (vLLM's own backends need CUDA on both ends and vLLM on the trainer's side, which has
none). Tensors come in the actor's Hugging Face names with a tied lm_head included (without it vLLM silently keeps the
old head). The trainer's side: components/serving/rollout/client.py.

The group admits the run's processes only: the worker joins the trainer's store with the run's secret (its
environment: $RLHF_RUN_SECRET or $RLHF_RUN_SECRET_FILE) and proves it, and checks the trainer's proof, before any
tensor (group.py). Every tensor received is digested (sha256); the server compares the digests with the trainer's
(POST /weights/digests) before the update counts (`received_digests`).

Runs in .venv-vllm: imports nothing from the project but this package and models/rendezvous.py (components/serving/
rollout/__init__.py).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from components.serving.rollout.group import join, read_secret, tensor_digest

TRANSFER_BACKEND = "rlhf_torch_group"  # our backend's name in vLLM's weight-transfer factory
INIT_CONNECT_TIMEOUT_S = 30.0  # /weights/init: how long joining the trainer's store may take (it listens already)


@dataclass
class GroupInitInfo(WeightTransferInitInfo):
    """Where the trainer's side of the group is: its TCPStore (the trainer is rank 0, this engine's workers ranks 1 to
    world_size - 1: one per tensor-parallel shard, as vLLM's own NCCL engine numbers them)."""

    master_address: str
    master_port: int
    backend: str = "gloo"
    timeout_s: float = 600.0
    world_size: int = 2


@dataclass
class GroupUpdateInfo(WeightTransferUpdateInfo):
    """The tensors of one update, in the order the trainer broadcasts them (the shape of vLLM's NCCL update info)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ready_key: str = ""  # set in the trainer's store once this side receives: the trainer broadcasts then


class TorchGroupWeightTransfer(WeightTransferEngine[GroupInitInfo, GroupUpdateInfo]):
    """vLLM weight-transfer engine over a torch.distributed group of the trainer and the engine's workers (no default
    process group on either side): the trainer broadcasts each tensor from rank 0, every worker receives it into a
    fresh buffer and loads it (its shard of it) at once through vLLM's layerwise reload (checkpoint format: vLLM
    repacks for its kernels)."""

    init_info_cls = GroupInitInfo
    update_info_cls = GroupUpdateInfo

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = self.store = None
        self.rank = 1
        self.received: list[str] = []  # the sha256 of every tensor received since the update started

    def init_transfer_engine(self, init_info: GroupInitInfo) -> None:
        secret = read_secret()
        if not secret:
            raise RuntimeError("weights/init: this server has no run secret to join the trainer's group with")
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        connect = datetime.timedelta(seconds=min(init_info.timeout_s, INIT_CONNECT_TIMEOUT_S))
        self.rank = 1 + self.parallel_config.rank  # this worker's place among the engine's tensor-parallel workers
        self.group, self.store = join(init_info.backend, init_info.master_address, init_info.master_port, self.rank,
                                      init_info.world_size, secret, self.device, timeout, connect)

    def start_weight_update(self) -> None:
        self.received = []
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GroupUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("weights/update: no transfer group; POST /weights/init first")

        def arriving():
            for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                self.group.broadcast(tensor, 0).wait()
                self.received.append(tensor_digest(tensor))
                yield name, tensor

        if update_info.ready_key:  # one key per worker: the trainer broadcasts once every worker receives
            self.store.set(f"{update_info.ready_key}-{self.rank}", "1")
        self.model.load_weights(arriving())

    def shutdown(self) -> None:
        self.group = None


def received_digests(worker) -> list[str]:
    """What a worker received in the update in progress, as digests (`llm.collective_rpc(received_digests)`)."""
    return list(worker.weight_transfer_engine.received)


WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, TorchGroupWeightTransfer)
