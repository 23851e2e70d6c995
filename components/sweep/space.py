"""A sweep's space checked against the run config, before any trial starts (pure: no server, no storage).

`check_sweep(config, sweep)` refuses, naming the field: a dotted field the config does not have, a field the sweep
itself sets (algorithm, run_name, tracking.parent_run_id), an arm (`arms`: a named partial config the space's `arm`
field picks) that sets a field the space varies or makes the same config as another arm, a range on a field that is not
a number, a value or a combination of values the config refuses (every grid combination; for random and tpe every
combination of the lists' values and the ranges' ends), and a metric that a trial's config cannot produce: one no run
logs (the list the code logs, models/metrics.py, generated into docs/metrics.md; the closest names are suggested), and
one this config does not log (a held-out eval it does not run, a gold reward it does not have, a critic's with an
algorithm that has none, the vLLM engine's with the native one). It returns the space as Optuna
distributions (and the grid's combinations), and `trial_config` makes a trial's config from the base config.
"""

from __future__ import annotations

import difflib
import itertools
import types
import typing
from dataclasses import dataclass
from typing import Any, Optional

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from pydantic import BaseModel, ValidationError

from components.sweep.config import ARM, SweepConfig
from models.algorithms import ALGORITHMS, resolve
from models.config import RLHFConfig, RunConfig, merge, nested
from models.data import builtin_gold
from models.metrics import find, names

# not a field of the space (an arm may set `algorithm`: its trials then run on its deployment); trials are named
SET_BY_THE_SWEEP = ("algorithm", "run_name", "tracking.parent_run_id")


class SweepError(ValueError):
    """A sweep that cannot run as given; the message names the field."""


@dataclass
class Space:
    """A checked space: an Optuna distribution per dotted field, and for grid every combination in the lists' order."""

    distributions: dict[str, BaseDistribution]
    grid: Optional[list[dict[str, Any]]] = None
    algorithms: tuple[str, ...] = ()  # every algorithm a trial can run (an arm may set its own): their deployments


def check_sweep(config: RLHFConfig, sweep: SweepConfig, pipeline: bool = False) -> Space:
    """The space of `sweep` over `config`, or a SweepError naming what is wrong (before any trial starts).
    `pipeline`: the trials are pipelines whose RL stage `config` is (their metric read from the pipeline's run)."""
    distributions = {field: distribution(field, values) for field, values in sweep.space.items()}
    check_arms(config, sweep)
    corners = {field: values if isinstance(values, list) else [_number(field, values.low), _number(field, values.high)]
               for field, values in sweep.space.items()}
    combinations = [dict(zip(corners, values)) for values in itertools.product(*corners.values())]
    algorithms = []
    for combination in combinations:
        cfg = valid_config(config, sweep, combination)
        if problem := metric_problem(cfg, sweep.metric, pipeline):
            where = "" if metric_problem(config, sweep.metric, pipeline) else f" (with {_show(combination)})"
            raise SweepError(f"sweep.metric: {problem}{where}")
        algorithms.append(cfg.algorithm)
    return Space(distributions, combinations if sweep.sampler == "grid" else None, tuple(dict.fromkeys(algorithms)))


def check_arms(config: RLHFConfig, sweep: SweepConfig) -> None:
    """Refuse an arm that sets a field the sweep sets or its space varies (e.g. `seed`: paired seeds are the same for
    every arm), one the config refuses, and two arms that make the same config."""
    made: dict[str, dict] = {}
    for name, arm in sweep.arms.items():
        for field in nested_fields(arm):
            if field == "seed" and "seed" in sweep.space:
                raise SweepError(f"arms.{name}: sets 'seed', and the seeds are paired: every arm runs every seed of "
                                 f"the experiment (common random numbers); give the arms no seed")
            if field in (*SET_BY_THE_SWEEP[1:], *sweep.space) or any(field.startswith(f"{f}.") for f in sweep.space):
                raise SweepError(f"arms.{name}: sets '{field}', which the "
                                 f"{'sweep' if field in SET_BY_THE_SWEEP else 'space'} sets for every trial (an arm "
                                 "may not change it)")
        try:
            made[name] = valid_config(config, sweep, {ARM: name}).model_dump(mode="json")
        except SweepError as exc:
            raise SweepError(f"arms.{name}: {str(exc).split(': ', 2)[-1]}") from None
    names = list(made)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            if made[first] == made[second]:
                raise SweepError(f"arms: {first} and {second} make the same config (nothing to compare): make them "
                                 f"differ, or drop one")


def nested_fields(values: dict, prefix: str = "") -> list[str]:
    """The dotted fields a partial config (nested and/or dotted keys) sets."""
    fields = []
    for key, value in values.items():
        name = f"{prefix}{key}"
        fields += nested_fields(value, f"{name}.") if isinstance(value, dict) and value else [name]
    return fields


def with_arm(sweep: SweepConfig, params: dict) -> dict:
    """A trial's values with its arm (the space's 'arm' field) as the partial config it names, the others over it."""
    if ARM not in params:
        return dict(params)
    return {**nested(sweep.arms[params[ARM]]), **{k: v for k, v in params.items() if k != ARM}}


def distribution(field: str, values) -> BaseDistribution:
    """The Optuna distribution of one entry of the space: a list -> categorical; a range -> int or float, by the
    type of the config field."""
    kind = field_type(field)
    if isinstance(values, list):
        return CategoricalDistribution(values)
    if kind is int:
        return IntDistribution(_number(field, values.low), _number(field, values.high), log=values.log)
    if kind is float:
        return FloatDistribution(values.low, values.high, log=values.log)
    raise SweepError(f"sweep.space['{field}']: a range {{low, high}} needs a numeric field, and {field} is "
                     f"{_type_name(kind)}: give a list of values")


def field_type(field: str) -> type:
    """The type of a dotted config field (Optional and constraints stripped); a SweepError when it does not exist."""
    if field == ARM:
        return str  # one of the sweep's arms (SweepConfig checks the names)
    if field in SET_BY_THE_SWEEP:
        raise SweepError(f"sweep.space: '{field}' cannot be swept (the sweep sets it: one algorithm and deployment "
                         f"per sweep, and the trials' names and parent run)")
    model: type[BaseModel] = RunConfig  # what a run trains: where a trial runs is its deployment's
    parts = field.split(".")
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "the config"
        if part not in model.model_fields:
            raise SweepError(f"sweep.space: '{field}' is not a config field: {where} has no field '{part}' "
                             f"(its fields: {', '.join(model.model_fields)})")
        kind = _strip(model.model_fields[part].annotation)
        if depth < len(parts) - 1:
            if not _is_section(kind):
                raise SweepError(f"sweep.space: '{field}' is not a config field: {'.'.join(parts[:depth + 1])} is a "
                                 f"value, not a section")
            model = kind
        elif _is_section(kind):
            raise SweepError(f"sweep.space: '{field}' is a section, not a field: name one of its fields "
                             f"({', '.join(kind.model_fields)})")
    return kind


def metric_problem(cfg: RLHFConfig, metric: str, pipeline: bool = False) -> Optional[str]:
    """Why a run of `cfg` (a pipeline whose RL stage it is) would never log `metric` (None when it can)."""
    entry = find(metric, "rl")
    if entry is None and pipeline and (entry := find(metric, "pipeline")) is not None:
        return None  # the pipeline's own: its eval stage's, a stage's last metrics
    if entry is None:
        known = names("pipeline" if pipeline else "rl")
        close = difflib.get_close_matches(metric, known, n=3, cutoff=0.5)
        return (f"'{metric}' is not a metric {'a pipeline' if pipeline else 'an RL run'} logs"
                + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
                + "; docs/metrics.md lists every metric the code logs")
    why = {"never": f"'{metric}' is logged once (at step 0 or per checkpoint), not a result to optimise",
           "eval": (f"'{metric}' is logged by the held-out eval, which this config does not run: set eval.prompts and "
                    f"eval.every > 0 (eval.prompts={cfg.eval.prompts!r}, eval.every={cfg.eval.every})"),
           "gold": f"'{metric}' needs a gold reward, and reward.gold is None (and data.prompts is not a builtin task)",
           "critic": f"'{metric}' comes from a critic, and {cfg.algorithm} has none",
           "rloo": f"'{metric}' is the REINFORCE family's, and {cfg.algorithm} has a critic",
           "vllm": f"'{metric}' comes from an engine with its own weights, and rollout.engine is "
                   f"{cfg.rollout.engine!r}",
           "async": f"'{metric}' needs asynchronous rollouts, and rollout.max_off_policy_steps is 0",
           "functions": f"'{metric}' needs reward functions, and reward.source is {cfg.reward.source!r}",
           "environment": f"'{metric}' is an environment run's, and neither environment.factory nor "
                          "environment.verifiers is set",
           "kl": f"'{metric}' needs a KL to the reference, and kl.beta is 0 for {cfg.algorithm}",
           "kl_loss": f"'{metric}' needs the KL in the loss (kl.placement=loss, kl.beta > 0)",
           "ratio_clip": f"'{metric}' needs a clipped ratio (loss.policy_loss=ppo)",
           "dual_clip": f"'{metric}' needs loss.clip_ratio_c",
           "vespo": f"'{metric}' needs loss.policy_loss=vespo",
           "dynamic": f"'{metric}' needs loss.dynamic_sampling",
           "opd": f"'{metric}' is on-policy distillation's (algorithm=opd)"}
    settings = resolve(cfg)
    held = {"never": False, "eval": bool(cfg.eval.prompts and cfg.eval.every),
            "gold": bool(cfg.reward.gold or builtin_gold(cfg.data.prompts)),
            "critic": ALGORITHMS[cfg.algorithm].needs_critic, "rloo": not ALGORITHMS[cfg.algorithm].needs_critic,
            "vllm": cfg.rollout.engine != "native", "async": cfg.rollout.max_off_policy_steps > 0,
            "functions": cfg.reward.source == "function", "binary": True, "environment": cfg.environment.enabled,
            "kl": settings.kl_beta > 0, "kl_loss": settings.kl_beta > 0 and not settings.kl_in_reward,
            "ratio_clip": settings.menu.policy_loss == "ppo", "dual_clip": settings.menu.clip_ratio_c is not None,
            "vespo": settings.menu.policy_loss == "vespo", "dynamic": settings.dynamic_sampling,
            "opd": ALGORITHMS[cfg.algorithm].needs_teacher}
    return next((why[need] for need in entry.needs if not held[need]), None)


def trial_config(config: RLHFConfig, sweep: SweepConfig, number: int, params: dict, parent_run_id: str) -> RLHFConfig:
    """The config of trial `number`: the base config with the trial's values, named '<sweep>-t<number>', nested under
    the sweep's MLflow run. (Where it runs is its deployment's: its servers pick free ports of their own.)"""
    return merge(config, {**with_arm(sweep, params), "run_name": f"{sweep.name}-t{number}",
                          "tracking.parent_run_id": parent_run_id})


def valid_config(config: RLHFConfig, sweep: SweepConfig, combination: dict) -> RLHFConfig:
    try:
        return merge(config, with_arm(sweep, combination))
    except ValidationError as exc:
        reasons = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise SweepError(f"sweep.space: the config refuses {_show(combination)}: {reasons}") from None


def _number(field: str, value: float):
    """A range end as the field's type: an int field takes whole numbers only."""
    if field_type(field) is int:
        if value != int(value):
            raise SweepError(f"sweep.space['{field}']: {field} is an int field, so the range needs whole numbers, "
                             f"got {value}")
        return int(value)
    return value


def _show(combination: dict) -> str:
    return ", ".join(f"{field}={value!r}" for field, value in combination.items())


def _strip(annotation):
    """int from Optional[Annotated[int, ...]], a section class from itself."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def _is_section(kind) -> bool:
    return isinstance(kind, type) and issubclass(kind, BaseModel)


def _type_name(kind) -> str:
    if typing.get_origin(kind) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(kind)))
    return f"of type {getattr(kind, '__name__', kind)}"
