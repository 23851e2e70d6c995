"""An experiment: arms x paired seeds, run as a grid sweep (the same fan-out, resume and nested MLflow runs as a
sweep's), then compared with interval estimates (components/sweep/statistics.py) in a generated report
(components/sweep/report.py). The `experiment` parameter of `experiment/default` and the file of `rlhf experiment
--config FILE`.

    name: lr-vs-kl                       # the parent MLflow run, the trials '<name>-t<N>', the report
    base: {eval: {prompts: builtin:sentiment, every: 4}, iterations: 12}    # as `rlhf train --config` takes it
    arms: {rloo: {}, grpo: {algorithm: grpo}}                               # arm -> a partial config over base
    seeds: 3                             # or [0, 1, 2]: seed s is the same for every arm (common random numbers)
    metrics: [eval/gold_reward]          # default: the held-out eval's main metric
    concurrency: 2                       # arm x seed runs at once

An arm's trials are runs of its algorithm's training deployment. The grid runs seed by seed (every arm of seed 0,
then of seed 1, ...), so an experiment stopped half-way has whole pairs.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, PositiveFloat, PositiveInt, field_validator, model_validator

from components.sweep.config import ARM, NAME_PATTERN, SweepConfig
from components.sweep.space import SweepError, check_arms, check_sweep, metric_problem, valid_config
from models.config import RLHFConfig, from_layers
from models.data import builtin_gold
from models.sections import Section

AGGREGATES = ("final", "auc")  # each metric of a run: its value at the last step, the area under its curve


class ExperimentConfig(Section):
    """Arms x paired seeds, compared with interval estimates (rliable)."""

    name: str = Field(
        pattern=NAME_PATTERN,
        description="Names the MLflow parent run, the runs '<name>-t<N>', the study and the report; reruns resume.")
    base: dict[str, Any] = Field(
        default_factory=dict,
        description="The partial run config every arm starts from (as `rlhf train --config` takes it).")
    arms: dict[str, dict[str, Any]] = Field(
        description="Arm name -> a partial config over `base`; an arm may set `algorithm`, not `seed`.")
    seeds: Union[PositiveInt, list[int]] = Field(3, description="How many seeds (0..n-1), or the seeds themselves; "
                                                 "every arm runs every seed.")
    metrics: Optional[list[str]] = Field(
        None, description="The MLflow metrics compared (final and auc); None = the held-out eval's main metric.")
    direction: Literal["maximize", "minimize"] = Field("maximize", description="Whether larger metrics are better.")
    concurrency: int = Field(
        1, ge=1, le=32, description="Arm x seed runs at once (each a flow run of its training deployment).")
    reps: int = Field(2000, ge=100, le=200_000, description="Bootstrap resamples of every interval (rliable's "
                                                            "stratified bootstrap).")
    confidence: float = Field(0.95, gt=0.5, lt=1.0, description="Size of every interval.")
    bootstrap_seed: int = Field(0, description="Seed of the bootstrap: the report's intervals are the same every "
                                               "time it is made.")
    storage: Optional[str] = Field(None, description="The study's storage, as sweep.storage.")
    poll_s: PositiveFloat = Field(5.0, description="Seconds between two readings of the runs' states and metrics.")

    @field_validator("arms")
    @classmethod
    def _has_arms(cls, arms: dict) -> dict:
        if not arms:
            raise ValueError("is empty: name at least one arm (arm -> a partial config over base)")
        return arms

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds):
        if isinstance(seeds, list) and (not seeds or len(set(seeds)) < len(seeds)):
            raise ValueError(f"needs distinct seeds, at least one, got {seeds}")
        return seeds

    @model_validator(mode="after")
    def _metrics_named(self) -> "ExperimentConfig":
        if self.metrics is not None and (not self.metrics or len(set(self.metrics)) < len(self.metrics)):
            raise ValueError(f"metrics: needs distinct metric names, at least one, got {self.metrics}")
        return self

    def seed_list(self) -> list[int]:
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)

    def metric_names(self, config: RLHFConfig) -> list[str]:
        """The metrics compared: as given, or the held-out eval's main one for the base config."""
        if self.metrics:
            return list(self.metrics)
        return ["eval/gold_reward" if config.reward.gold or builtin_gold(config.data.prompts) else "eval/reward"]

    def base_config(self, deploy: Optional[dict] = None) -> RLHFConfig:
        """The base run config (over the preset it names), with where it runs."""
        return from_layers(self.base, {"deploy": deploy or {}})

    def as_sweep(self, config: RLHFConfig) -> SweepConfig:
        """The grid sweep that runs it: seed outer, arm inner; its metric the first compared one."""
        return SweepConfig(name=self.name, space={"seed": self.seed_list(), ARM: list(self.arms)}, arms=self.arms,
                           sampler="grid", concurrency=self.concurrency, metric=self.metric_names(config)[0],
                           direction=self.direction, storage=self.storage, poll_s=self.poll_s)


def check_experiment(config: RLHFConfig, experiment: ExperimentConfig) -> SweepConfig:
    """The experiment's sweep, or a SweepError naming what is wrong, before any run starts: an arm that sets the
    seed (or what the sweep sets), arms that make the same config, an arm the config refuses, and a metric that no
    run logs or that an arm's run would not log."""
    sweep = experiment.as_sweep(config)
    check_arms(config, sweep)
    for metric in experiment.metric_names(config):
        for arm in experiment.arms:
            if problem := metric_problem(valid_config(config, sweep, {ARM: arm}), metric):
                raise SweepError(f"experiment.metrics: {problem} (arm {arm})")
    check_sweep(config, sweep)
    return sweep
