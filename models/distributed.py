"""torch.distributed for the actor: who this process is, the few collectives the RL math needs, FSDP2 wrapping.

Every function takes a `Dist`; with one rank (`SINGLE`) they are identities, so the step functions have one code path
whether they run on one process or N. Collectives run on the default process group, which `init` creates with a
bounded timeout: a rank that died or hangs fails the others within `actor.collective_timeout_s`, never 30 minutes.

No channel between the ranks runs code or admits a stranger: objects travel as JSON and tensors (models/wire.py),
never pickles; the group meets through a store of rank 0's, listening on rank 0's address alone, whose keys and
values only holders of the run's secret can make, and every rank proves that secret before anything else is
exchanged (models/rendezvous.py).
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from models import rendezvous, wire
from models.loading import DTYPES


@dataclass(frozen=True)
class Dist:
    """This process's place in the actor's process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- collectives (identities on one rank)
    def all_reduce(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """A reduced copy of `tensor` (sum or max over ranks)."""
        if not self.active:
            return tensor
        out = tensor.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return out

    def broadcast_object(self, obj=None, src: int = 0):
        """`obj` from rank `src` on every rank (JSON and tensors: models/wire.py)."""
        if not self.active:
            return obj
        device = wire_device()
        payload = wire.encode(obj).to(device) if self.rank == src else None
        size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
        dist.broadcast(size, src)
        if payload is None:
            payload = torch.empty(int(size), dtype=torch.uint8, device=device)
        dist.broadcast(payload, src)
        return obj if self.rank == src else wire.decode(payload, f"rank {src}")

    def gather_object(self, obj) -> list | None:
        """Every rank's `obj` on rank 0 (rank order), None elsewhere."""
        if not self.active:
            return [obj]
        payload, sizes = self._sized(obj)
        width = max(sizes)
        parts = [torch.empty(width, dtype=torch.uint8, device=payload.device) for _ in range(self.world_size)]
        dist.gather(_padded(payload, width), parts if self.is_leader else None, dst=0)
        if not self.is_leader:
            return None
        return [obj if r == 0 else wire.decode(parts[r][:sizes[r]], f"rank {r}") for r in range(self.world_size)]

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj` on every rank (rank order)."""
        if not self.active:
            return [obj]
        payload, sizes = self._sized(obj)
        width = max(sizes)
        parts = [torch.empty(width, dtype=torch.uint8, device=payload.device) for _ in range(self.world_size)]
        dist.all_gather(parts, _padded(payload, width))
        return [obj if r == self.rank else wire.decode(parts[r][:sizes[r]], f"rank {r}")
                for r in range(self.world_size)]

    def scatter_object(self, objs: list | None):
        """Rank r gets objs[r] from rank 0."""
        if not self.active:
            return objs[0]
        device = wire_device()
        payloads = [wire.encode(o).to(device) for o in objs] if self.is_leader else None
        sizes = torch.tensor([p.numel() for p in payloads] if payloads else [0] * self.world_size, dtype=torch.int64,
                             device=device)
        dist.broadcast(sizes, 0)
        width = int(sizes.max())
        mine = torch.empty(width, dtype=torch.uint8, device=device)
        dist.scatter(mine, [_padded(p, width) for p in payloads] if payloads else None, src=0)
        return objs[0] if self.is_leader else wire.decode(mine[:int(sizes[self.rank])], "rank 0")

    def _sized(self, obj) -> tuple[Tensor, list[int]]:
        """`obj` encoded, on the collectives' device, and every rank's payload size."""
        payload = wire.encode(obj).to(wire_device())
        sizes = [torch.zeros(1, dtype=torch.int64, device=payload.device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device))
        return payload, [int(s) for s in sizes]

    def all_gather_cat(self, tensor: Tensor) -> Tensor:
        """Concatenation (dim 0, rank order) of every rank's `tensor`; shapes may differ in dim 0."""
        if not self.active:
            return tensor
        return torch.cat(self.all_gather_object(tensor.detach().cpu()))

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    # -- data
    def shard(self, n: int) -> slice:
        """This rank's contiguous block of n items (block sizes differ by at most one, rank order)."""
        return shard_slice(n, self.rank, self.world_size)


SINGLE = Dist()


def wire_device() -> torch.device:
    """Where the default group's collectives take their tensors: the current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _padded(payload: Tensor, width: int) -> Tensor:
    """`payload` right-padded with zeros to `width` bytes (collectives take tensors of one size); on CPU with numpy
    (models/wire.py says why)."""
    if payload.numel() == width:
        return payload
    if payload.device.type != "cpu":
        return torch.nn.functional.pad(payload, (0, width - payload.numel()))
    out = np.zeros(width, dtype=np.uint8)
    out[:payload.numel()] = payload.numpy()
    return torch.from_numpy(out)


def shard_slice(n: int, rank: int, world_size: int) -> slice:
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def from_env() -> Dist:
    """The Dist that torchrun (or our own launcher) describes in RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    return Dist(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")),
                int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


def init(me: Dist, backend: str, timeout_s: float, device: torch.device, secret: str,
         address: tuple[str, int] | None = None, name: str = "actor") -> Dist:
    """Join the process group `name` as `me` (a no-op for one rank), proving the run's `secret`: through rank 0's
    store at `address` (host, port), else where the environment says (`rendezvous_address`); rank 0 listens there,
    on that address alone. Every rank proves the secret before anything else is exchanged (RendezvousRefused naming
    a rank that does not). CPU ranks share the cores this process may run on (a node group's share of a machine:
    components/launch/nodes.py): cores / local ranks threads each."""
    if not me.active:
        return me
    if device.type == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // me.local_world_size))
    if not dist.is_initialized():
        if not secret:
            raise rendezvous.RendezvousRefused(f"{name} rank {me.rank}: no run secret to prove: the ranks admit only "
                                               f"processes that hold it ($RLHF_RUN_SECRET, set by who starts them)")
        host, port = address or rendezvous_address()
        timeout = datetime.timedelta(seconds=timeout_s)
        store, _ = rendezvous.open_store(host, port, me.world_size, me.is_leader, secret, timeout)
        dist.init_process_group(backend, store=store, rank=me.rank, world_size=me.world_size, timeout=timeout)
        rendezvous.prove(dist.group.WORLD, me.rank, me.world_size, secret, wire_device(), name)
    return me


def rendezvous_address(env=os.environ) -> tuple[str, int]:
    """Where rank 0's store listens: $MASTER_ADDR at $MASTER_PORT, or at $MASTER_PORT + 1 under torchrun, whose
    agents' own store holds $MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE)."""
    port = int(env["MASTER_PORT"])
    return env["MASTER_ADDR"], port + 1 if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else port


def resolve_backend(backend: str, device: torch.device) -> str:
    return ("nccl" if device.type == "cuda" else "gloo") if backend == "auto" else backend


def local_device(device: str, me: Dist) -> torch.device:
    """'auto': cuda:<local rank> when CUDA exists, else cpu; an explicit 'cuda' gets the local rank's index."""
    if device in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(me.local_rank)
        return torch.device("cuda", me.local_rank)
    return torch.device("cpu" if device == "auto" else device)


def shutdown(me: Dist = SINGLE, graceful: bool = False) -> None:
    """Leave the process group. `graceful` (the normal end, every rank alive): meet at a barrier first, so no rank
    closes its connections while a peer's gloo threads still use them (which aborts the peer)."""
    if dist.is_initialized():
        if graceful and me.active:
            dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------- FSDP2

def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of any HF model, found from its `_no_split_modules` (e.g. GPT2Block, LlamaDecoderLayer)."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"cannot shard {type(model).__name__}: it declares no _no_split_modules (transformer blocks)")
    return blocks


def shard_model(model: nn.Module, compute_dtype: str = "float32", reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2: `fully_shard` every transformer block, then the root. Its reduce-scatter averages gradients over ranks
    (callers scale their loss by the world size to get the sum). `compute_dtype` other than float32 (model.dtype):
    FSDP2's MixedPrecisionPolicy, the float32 shards all-gathered in that dtype for the forward and backward (half the
    unsharded block's memory and traffic) and gradients reduced in float32 into the float32 shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # heavy: FSDP (~1.2 s), only when sharding

    kwargs = {"reshard_after_forward": reshard_after_forward}
    if compute_dtype != "float32":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[compute_dtype], reduce_dtype=torch.float32)
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether `shard_model` wrapped it. A process that never imported FSDP cannot hold an FSDP module, and is spared
    FSDP's import (~1.2 s of CPU in every single-rank process: the flow run, the CLI, the servers)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def sum_gradients(params: list[nn.Parameter], me: Dist) -> None:
    """Replicated parameters (FSDP off, LoRA adapters): sum their gradients over ranks, flattened into one call."""
    if not me.active:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The full (unsharded) state dict on CPU: on every rank for a replicated model, on rank 0 only for FSDP."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # heavy: dcp (~1.7 s)

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer states (its local shards)."""
    def local(t: Tensor) -> Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    grads = sum(local(p.grad).numel() * local(p.grad).element_size() for p in model.parameters() if p.grad is not None)
    states = sum(local(v).numel() * local(v).element_size() for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, Tensor) and v.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": states}


# ---------------------------------------------------------------- rows of all ranks on rank 0 and back

def leader_batch(me: Dist, fields: dict, pad_id: int = 0) -> dict | None:
    """Every rank's rows of `fields` concatenated in rank order on rank 0 (None elsewhere), with `sizes` (rows per
    rank). [B, T] tensors are right-padded to the widest T (`tokens` with pad_id, the rest with 0); lists
    concatenate."""
    return _concat(me.gather_object(_cpu(fields)), fields, pad_id)


def all_rows(me: Dist, fields: dict, pad_id: int = 0) -> dict:
    """`leader_batch` on every rank: all ranks' rows of `fields`, rank order, padded alike, with `sizes`."""
    return _concat(me.all_gather_object(_cpu(fields)), fields, pad_id)


def _cpu(fields: dict) -> dict:
    return {k: v.cpu() if isinstance(v, Tensor) else v for k, v in fields.items()}


def _concat(parts: list[dict] | None, fields: dict, pad_id: int) -> dict | None:
    if parts is None:
        return None
    if len(parts) == 1:
        return {**parts[0], "sizes": [len(next(iter(parts[0].values())))]}
    out = {}
    for key, first in parts[0].items():
        values = [p[key] for p in parts]
        if isinstance(first, Tensor) and first.dim() == 2:
            width = max(v.shape[1] for v in values)
            fill = pad_id if key == "tokens" else 0
            values = [torch.nn.functional.pad(v, (0, width - v.shape[1]), value=fill) for v in values]
        out[key] = torch.cat(values) if isinstance(first, Tensor) else [x for v in values for x in v]
    out["sizes"] = [len(p[next(iter(fields))]) for p in parts]
    return out
