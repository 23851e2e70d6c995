"""torch.distributed for the actor: who this process is, the few collectives the RL math needs, FSDP2 wrapping.

Every function takes a `Dist`; with one rank (`SINGLE`) they are identities, so the step functions have one code path
whether they run on one process or N. Collectives run on the default process group, which `init` creates with a
bounded timeout: a rank that died or hangs fails the others within `actor.collective_timeout_s`, never 30 minutes.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

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
        """`obj` from rank `src` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def gather_object(self, obj) -> list | None:
        """Every rank's `obj` on rank 0 (rank order), None elsewhere."""
        if not self.active:
            return [obj]
        out = [None] * self.world_size if self.is_leader else None
        dist.gather_object(obj, out, dst=0)
        return out

    def scatter_object(self, objs: list | None):
        """Rank r gets objs[r] from rank 0."""
        if not self.active:
            return objs[0]
        box = [None]
        dist.scatter_object_list(box, objs if self.is_leader else None, src=0)
        return box[0]

    def all_gather_cat(self, tensor: Tensor) -> Tensor:
        """Concatenation (dim 0, rank order) of every rank's `tensor`; shapes may differ in dim 0."""
        if not self.active:
            return tensor
        parts = [None] * self.world_size
        dist.all_gather_object(parts, tensor.detach().cpu())
        return torch.cat(parts)

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    # -- data
    def shard(self, n: int) -> slice:
        """This rank's contiguous block of n items (block sizes differ by at most one, rank order)."""
        return shard_slice(n, self.rank, self.world_size)


SINGLE = Dist()


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


def init(me: Dist, backend: str, timeout_s: float, device: torch.device, init_method: str | None = None) -> Dist:
    """Join the process group as `me` (a no-op for one rank): at `init_method` (tcp://host:port), else where the
    environment says (MASTER_ADDR/MASTER_PORT). CPU ranks share the cores this process may run on (a node group's
    share of a machine: components/launch/nodes.py): cores / local ranks threads each."""
    if not me.active:
        return me
    if device.type == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // me.local_world_size))
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method or "env://", rank=me.rank, world_size=me.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return me


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
    rank). [B, T] tensors are right-padded to the widest T (`tokens` with pad_id, the rest with 0); lists concatenate."""
    return _concat(me.gather_object(_cpu(fields)), fields, pad_id)


def all_rows(me: Dist, fields: dict, pad_id: int = 0) -> dict:
    """`leader_batch` on every rank: all ranks' rows of `fields`, rank order, padded alike, with `sizes`."""
    if not me.active:
        return _concat([_cpu(fields)], fields, pad_id)
    parts = [None] * me.world_size
    dist.all_gather_object(parts, _cpu(fields))
    return _concat(parts, fields, pad_id)


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
