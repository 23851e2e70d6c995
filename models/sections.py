"""The building blocks of the config tree, shared by models/config.py and the algorithms' own sections, and where
local state lives (light: the CLI reads it without loading torch).

A `Section` refuses unknown keys (a typo in a config is an error naming it) and re-validates on assignment. A section
may hold named values (`named`: the run config's `preset`, the deployment's `placement`): the field `named` says
which set of values fills every field the given data leaves unset, when the section is built.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationInfo, model_validator


STATE_DIR_ENV = "RLHF_STATE_DIR"


def default_state_dir() -> Path:
    """Where local state lives (models, checkpoints, Prefect/MLflow databases): $RLHF_STATE_DIR or ./.rlhf."""
    return Path(os.environ.get(STATE_DIR_ENV, ".rlhf")).absolute()


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    # fields a user rarely sets (request limits, threads and cores, timeouts, ports): `rlhf config --describe` leaves
    # them out, `--describe --all` lists them; the config reference marks them
    advanced: ClassVar[tuple[str, ...]] = ()
    # named values: the field that names them ('' = none) and each name's dotted values
    named: ClassVar[str] = ""
    named_values: ClassVar[dict[str, dict]] = {}

    @model_validator(mode="before")
    @classmethod
    def _named_values(cls, data, info: ValidationInfo):
        """The values the `named` field names, under what `data` gives, when the section is built (not on an
        assignment to one of its fields: `data` is then every field's value); an unknown name fails as the field's
        own error."""
        if not cls.named or not isinstance(data, dict) or not cls.named_values.get(data.get(cls.named)):
            return data
        if info.field_name in cls.model_fields and set(cls.model_fields) <= set(data):  # an assignment to one field
            return data
        return deep_merge(nested(cls.named_values[data[cls.named]]), given(data))


def nested(overrides: dict) -> dict:
    """{"a.b": 1, "a": {"c": 2}} -> {"a": {"b": 1, "c": 2}}: dotted keys as the mappings they name, merged."""
    out: dict = {}
    for key, value in overrides.items():
        *parents, last = key.split(".")
        part = {last: value}
        for parent in reversed(parents):
            part = {parent: part}
        out = deep_merge(out, part)
    return out


def deep_merge(base: dict, new: dict) -> dict:
    """`new` over `base`, mappings merged key by key at every depth (a value that is not a mapping replaces)."""
    out = dict(base)
    for k, v in new.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def given(data):
    """`data` with every section instance in it as the mapping of what was set in it."""
    if isinstance(data, BaseModel):
        return given(data.model_dump(exclude_unset=True))
    if isinstance(data, dict):
        return {k: given(v) for k, v in data.items()}
    return data


class OptimConfig(Section):
    advanced: ClassVar[tuple[str, ...]] = ("weight_decay", "betas", "total_steps")  # `rlhf config --describe --all`
    lr: float = Field(1e-6, gt=0, description="Peak learning rate (AdamW; 1e-6 as the actor in TRL and veRL).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="LR schedule after warm-up.")
    total_steps: Optional[PositiveInt] = Field(
        None, description="Steps for cosine/linear decay; None derives it from iterations.")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
