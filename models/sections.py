"""The building blocks of the config tree, shared by models/config.py and the algorithms' own sections, and where
local state lives (light: the CLI reads it without loading torch).

A `Section` refuses unknown keys (a typo in a config is an error naming it) and re-validates on assignment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


STATE_DIR_ENV = "RLHF_STATE_DIR"


def default_state_dir() -> Path:
    """Where local state lives (models, checkpoints, Prefect/MLflow databases): $RLHF_STATE_DIR or ./.rlhf."""
    return Path(os.environ.get(STATE_DIR_ENV, ".rlhf")).absolute()


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    # fields a user rarely sets (request limits, threads and cores, timeouts, ports): `rlhf config --describe` leaves
    # them out, `--describe --all` lists them; the config reference marks them
    advanced: ClassVar[tuple[str, ...]] = ()


class OptimConfig(Section):
    advanced: ClassVar[tuple[str, ...]] = ("weight_decay", "betas", "total_steps")  # `rlhf config --describe --all`
    lr: float = Field(1e-6, gt=0, description="Peak learning rate (AdamW); 1e-6 is the actor's in TRL's RLOO/GRPO and veRL's examples; the tiny preset uses 3e-4 (actor) and 1e-3 (critic).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="LR schedule after warm-up.")
    total_steps: Optional[PositiveInt] = Field(None, description="Steps for cosine/linear decay; None derives it from iterations.")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
