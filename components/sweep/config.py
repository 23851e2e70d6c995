"""The `sweep` section: what a sweep searches, how, and what it optimises (the second parameter of `sweep/default`
and of `rlhf sweep`). Light (pydantic only): the CLI's parser builds its flags from these fields.

The checks here need no run config (names, shapes, bounds); components/sweep/space.py checks the space against the
run config (each field exists, each combination is a valid config, the config logs the metric).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (Discriminator, Field, PositiveFloat, PositiveInt, StrictBool, StrictInt, Tag, field_validator,
                      model_validator)

from models.sections import Section

SWEEP_STORAGE_ENV = "RLHF_SWEEP_STORAGE"
ARM = "arm"  # the space's field that picks one of `arms` (a named partial config) rather than one config field
NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
Value = Union[StrictBool, StrictInt, float, str, None]  # what Optuna stores as a categorical choice


class Range(Section):
    """A numeric range of one config field: ints for an int field (Optuna's IntDistribution), floats otherwise."""

    low: float = Field(description="Smallest value (included).")
    high: float = Field(description="Largest value (included).")
    log: bool = Field(False, description="Sample on a log scale (learning rates, KL coefficients); needs low > 0.")

    @model_validator(mode="after")
    def _ordered(self) -> "Range":
        if not (math.isfinite(self.low) and math.isfinite(self.high)) or self.low >= self.high:
            raise ValueError(f"needs finite low < high, got low={self.low}, high={self.high}")
        if self.log and self.low <= 0:
            raise ValueError(f"log=true needs low > 0, got low={self.low}")
        return self


# a list is categorical, anything else is read as a range (so an error names the one it was meant to be)
Values = Annotated[Union[Annotated[list[Value], Tag("values")], Annotated[Range, Tag("range")]],
                   Discriminator(lambda v: "values" if isinstance(v, (list, tuple)) else "range")]


class SweepConfig(Section):
    """A hyperparameter sweep: an Optuna study whose trials are runs of the algorithm's training deployment."""

    name: str = Field(
        pattern=NAME_PATTERN,
        description="Names the study, its MLflow parent run and trials '<name>-t<N>'; rerunning a name resumes it.")
    space: dict[str, Values] = Field(
        description="Dotted config field -> a list of values or a {low, high, log} range (docs/sweeps.md).")
    arms: dict[str, dict[str, Any]] = Field(
        {}, description="Named partial run configs, which the space's 'arm' field chooses between (docs/sweeps.md).")
    sampler: Literal["grid", "random", "tpe"] = Field(
        "grid", description="grid (every combination of the lists), random or tpe (Optuna's samplers).")
    trials: PositiveInt = Field(
        8, description="How many trials random and tpe run in all, earlier runs' finished ones counted.")
    seed: int = Field(0, description="Seed of the random and tpe samplers.")
    concurrency: int = Field(
        1, ge=1, le=32, description="Trials running at once (each a flow run of the training deployment).")
    metric: str = Field("eval/reward", description="The MLflow metric to optimise, at a trial's last logged step.")
    direction: Literal["maximize", "minimize"] = Field(
        "maximize", description="Whether a larger or a smaller metric is better.")
    pruner: Literal["none", "median"] = Field(
        "none",
        description="median = Optuna's MedianPruner (cancels a trial worse than the median at a step); none = off.")
    warmup_steps: int = Field(1, ge=0, description="The pruner judges no step below this one (step = iteration).")
    startup_trials: int = Field(1, ge=0, description="Completed trials needed before the pruner stops any.")
    storage: Optional[str] = Field(
        None,
        description=f"SQLAlchemy URL of the study storage; None = ${SWEEP_STORAGE_ENV}, else sqlite in state_dir.")
    poll_s: PositiveFloat = Field(5.0, description="Seconds between two readings of the trials' states and metrics.")

    @field_validator("space")
    @classmethod
    def _not_empty(cls, space: dict) -> dict:
        if not space:
            raise ValueError("is empty: give at least one dotted config field and its values, "
                             "e.g. {'reinforce.optim.lr': [1e-4, 3e-4]}")
        for field, values in space.items():
            if isinstance(values, list) and not values:
                raise ValueError(f"'{field}' has an empty list of values")
            if isinstance(values, list) and len(set(map(repr, values))) < len(values):
                raise ValueError(f"'{field}' lists a value twice: {values}")
        return space

    @model_validator(mode="after")
    def _arms_are_named(self) -> "SweepConfig":
        if ARM in self.space:
            chosen = self.space[ARM]
            if not isinstance(chosen, list) or not self.arms:
                raise ValueError("space['arm'] picks one of `arms` (named partial configs): give `arms` and a list "
                                 "of their names")
            if unknown := [name for name in chosen if name not in self.arms]:
                raise ValueError(f"space['arm']: {unknown} are not arms (the arms: {', '.join(self.arms)})")
        elif self.arms:
            raise ValueError("arms are given and space has no 'arm' field to choose them: add "
                             f"'arm': {list(self.arms)} to the space")
        for name in self.arms:
            if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,40}", name):
                raise ValueError(f"arms: the name {name!r} needs lowercase letters, digits, '_' and '-' (at most 41)")
        return self

    @model_validator(mode="after")
    def _grid_takes_lists(self) -> "SweepConfig":
        if self.sampler == "grid":
            ranges = [field for field, values in self.space.items() if isinstance(values, Range)]
            if ranges:
                raise ValueError(f"space: {', '.join(ranges)}: sampler 'grid' needs a list of values; a range "
                                 f"{{low, high}} needs sampler 'random' or 'tpe'")
        return self
