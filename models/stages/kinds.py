"""The stages that train on the actor's ranks, by name (each kind's `trainer`, declared in models/kinds.py), and what
a rank builds for one."""

from __future__ import annotations

import torch

from models.distributed import SINGLE, Dist, local_device
from models.loading import make_optimizer
from models.kinds import KINDS as JOB_KINDS
from models.kinds import load
from models.stages.config import StageRun
from models.stages.train import StageKind, StageState

KINDS: dict[str, StageKind] = {kind.job: load(kind.trainer)() for kind in JOB_KINDS if kind.trains_on_ranks}


def stage_kind(stage: str) -> StageKind:
    """The trainer of a stage (models/kinds.STAGES)."""
    return KINDS[stage]


def build_stage(cfg: StageRun, me: Dist = SINGLE) -> StageState:
    """This rank's trainee of `cfg.stage` (sharded with FSDP2 over the ranks for a full fine-tune unless
    deploy.actor.fsdp='off'), its optimizer and generators."""
    torch.manual_seed(cfg.seed)  # the same new score head on every rank
    train, kind = cfg.train, stage_kind(cfg.stage)
    shard = me.active and cfg.deploy.actor.fsdp == "auto" and not train.lora.enabled
    trainee = kind.build(cfg, cfg.local_path("model"), local_device(cfg.deploy.device, me), me, shard)
    trainee.model.train()
    optimizer, scheduler = make_optimizer(trainee.trainable_parameters(), train.optim)
    return StageState(trainee, kind, optimizer, scheduler,
                      torch.Generator().manual_seed(cfg.seed + 1_000_003 * me.rank),
                      torch.Generator().manual_seed(cfg.seed), me)
