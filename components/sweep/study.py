"""The Optuna side of a sweep: its study (sampler, pruner, RDB storage), resumed by name, and the trials a run of the
sweep still has to start.

Optuna owns the search: the samplers, the median pruner and the persistence are Optuna's. A grid enqueues its
combinations in the lists' order (Optuna's `enqueue_trial`), so a rerun can tell which ones are done; random and tpe
ask the sampler. What a rerun keeps: COMPLETE and PRUNED trials. A trial still RUNNING in the storage belongs to a run
of the sweep that died: the new run follows its flow run to the end (components/sweep/trials.py); a FAIL is run again.
"""

from __future__ import annotations

import json
import logging
import os

import optuna
from optuna.trial import FrozenTrial, TrialState

from components.sweep.config import SWEEP_STORAGE_ENV, SweepConfig
from components.sweep.space import Space, SweepError
from components.tracking.tracker import redact
from models.config import RLHFConfig

KEPT = (TrialState.COMPLETE, TrialState.PRUNED)  # what a rerun of the sweep does not run again
STATE_NAMES = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed",
               TrialState.RUNNING: "running", TrialState.WAITING: "waiting"}


def storage_url(config: RLHFConfig, sweep: SweepConfig) -> str:
    """sweep.storage > $RLHF_SWEEP_STORAGE > sqlite:///<state_dir>/sweeps/optuna.db."""
    if sweep.storage or os.environ.get(SWEEP_STORAGE_ENV):
        return sweep.storage or os.environ[SWEEP_STORAGE_ENV]
    path = config.resolved_state_dir() / "sweeps" / "optuna.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def definition(config: RLHFConfig, sweep: SweepConfig) -> str:
    """What a rerun under the same name must repeat: the base config and what and how the sweep searches."""
    return json.dumps({"config": config.run.model_dump(mode="json"), "space": sweep.model_dump(mode="json")["space"],
                       "arms": sweep.model_dump(mode="json")["arms"],
                       "sampler": sweep.sampler, "seed": sweep.seed, "metric": sweep.metric,
                       "direction": sweep.direction}, sort_keys=True)


def open_study(config: RLHFConfig, sweep: SweepConfig, space: Space) -> optuna.Study:
    """The sweep's study, created or loaded by name from its storage; a study of that name with another definition
    is refused (pick another name)."""
    optuna.logging.set_verbosity(logging.WARNING)
    url = storage_url(config, sweep)
    samplers = {"grid": lambda: optuna.samplers.GridSampler(_lists(sweep), seed=sweep.seed),
                "random": lambda: optuna.samplers.RandomSampler(seed=sweep.seed),
                "tpe": lambda: optuna.samplers.TPESampler(seed=sweep.seed)}
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=sweep.startup_trials, n_warmup_steps=sweep.warmup_steps)
              if sweep.pruner == "median" else optuna.pruners.NopPruner())
    study = optuna.create_study(storage=url, study_name=sweep.name, sampler=samplers[sweep.sampler](), pruner=pruner,
                                direction=sweep.direction, load_if_exists=True)
    mine = definition(config, sweep)
    stored = study.user_attrs.get("definition")
    if stored is None:
        study.set_user_attr("definition", mine)
    elif stored != mine:
        differ = [key for key, value in json.loads(mine).items() if json.loads(stored).get(key) != value]
        raise SweepError(f"sweep.name: the study '{sweep.name}' in {redact(url)} was started with another "
                         f"{' and '.join(differ)}; rerun it with the same ones to resume it, or give the sweep "
                         "another name")
    for _ in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):  # enqueued by a run that died
        trial = study.ask()
        trial.set_user_attr("reason", "enqueued by a run of the sweep that stopped before starting it")
        study.tell(trial, state=TrialState.FAIL)
    return study


def unfinished(study: optuna.Study) -> list[FrozenTrial]:
    """Trials a run of this sweep started and never told the end of (it died): their flow runs may still run."""
    return study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))


class Plan:
    """The trials this run of the sweep still has to start: the grid's combinations that no kept or followed trial
    has, in the lists' order; for random and tpe, `sweep.trials` minus the kept and followed ones. `ask()` starts the
    next one in the study."""

    def __init__(self, study: optuna.Study, space: Space, sweep: SweepConfig, followed: list):
        self.study, self.space = study, space
        done = study.get_trials(deepcopy=False, states=KEPT) + list(followed)
        if space.grid is not None:
            taken = [trial.params for trial in done]
            self.combinations = [c for c in space.grid if c not in taken]
            self.left = len(self.combinations)
        else:
            self.left = max(0, sweep.trials - len(done))

    def __bool__(self) -> bool:
        return self.left > 0

    def ask(self) -> optuna.Trial:
        if self.space.grid is not None:
            self.study.enqueue_trial(self.combinations.pop(0))
        self.left -= 1
        return self.study.ask(self.space.distributions)


def label(trial: FrozenTrial) -> str:
    return STATE_NAMES.get(trial.state, trial.state.name.lower())


def _lists(sweep: SweepConfig) -> dict[str, list]:
    return {field: values for field, values in sweep.space.items() if isinstance(values, list)}
