"""A sweep's trials in flight. Each trial is a flow run of the algorithm's training deployment (Prefect's
`run_deployment`, a child of the sweep's flow run in the Prefect UI), so on a cluster it runs on the work pool's GPU
nodes like any run. The sweep follows them through the Prefect API (states) and MLflow (the sweep's metric, by step):

- every new step of the metric is reported to Optuna (`trial.report`); when the pruner says so (`should_prune`), the
  trial's flow run is cancelled through Prefect (Cancelling, as the UI's Cancel button does: its servers and ranks are
  stopped by the flow run itself) and the study is told PRUNED;
- a flow run that completes gives the metric at its last step as the trial's value (COMPLETE); one that fails, crashes
  or is cancelled by someone else, or that logged no such metric, is a FAIL with the reason; the sweep goes on;
- a trial keeps its slot until its flow run has ended, so no more than `sweep.concurrency` run at once;
- if the sweep itself stops (a failure, or its own cancellation), the trials it started are cancelled and told FAIL
  (a rerun runs them again); if it dies without a word (killed), a rerun follows them (`follow`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Callable, Optional
from uuid import UUID

import optuna
from optuna.trial import FrozenTrial, TrialState
from prefect import get_client, get_run_logger
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, FlowRunFilterTags
from prefect.client.schemas.objects import State
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL
from prefect.states import Cancelling

from components.environment import first_line
from components.sweep.config import SweepConfig
from components.sweep.space import Space, SweepError, trial_config
from components.sweep.tracking import SweepRun
from models.config import RLHFConfig

MAX_POLL_ERRORS = 10


def require_deployment(name: str) -> None:
    """Trials run on the training deployment: refuse a sweep whose deployment the Prefect API does not have."""
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(name)
        except ObjectNotFound:
            raise SweepError(f"config.algorithm: its deployment {name} does not exist at {PREFECT_API_URL.value()}: "
                             f"serve the deployments (`rlhf up`, or `prefect deploy` on a cluster)") from None


def cancel(flow_run_id: UUID, message: str) -> None:
    """Cancel a flow run as the UI's Cancel button does (Cancelling: its runner stops its process)."""
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        if state is None or not state.is_final():
            client.set_flow_run_state(flow_run_id, Cancelling(message=message), force=True)


@dataclass
class Running:
    """A trial holding a slot: its Optuna trial, its flow run, its MLflow run once the flow run created it."""

    trial: optuna.Trial
    flow_run_id: UUID
    run_name: str
    mlflow_run_id: Optional[str] = None
    reported: dict[int, float] = field(default_factory=dict)  # step -> value of the metric, reported to Optuna
    pruned: Optional[FrozenTrial] = None  # told PRUNED and cancelled; holds its slot until its flow run has ended


class Trials:
    """The trials this run of the sweep started or follows."""

    def __init__(self, config: RLHFConfig, sweep: SweepConfig, space: Space, study: optuna.Study, parent: SweepRun,
                 deployment: Callable[[RLHFConfig], str], parameters: Callable[[RLHFConfig], dict] | None = None):
        self.config, self.sweep, self.space, self.study, self.parent = config, sweep, space, study, parent
        self.deployment = deployment  # the deployment a trial's config runs on (its algorithm's, or the pipeline's)
        # a trial's flow-run parameters from its config: the run config itself (flows/sweep.py adds what the sweep
        # was told of where trials run), or (a pipeline's sweep) the pipeline with the trial's config as its RL stage
        self.parameters = parameters or (lambda cfg: {"config": cfg.run.model_dump(mode="json")})
        self.running: dict[int, Running] = {}
        self.errors = 0  # failed polls in a row
        self.logger = get_run_logger()

    def __enter__(self) -> "Trials":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None and self.running:  # a failure, or the sweep's cancellation (SIGTERM) / Ctrl-C
            self.stop_all(f"the sweep failed: {first_line(exc)}" if isinstance(exc, Exception)
                          else f"the sweep was cancelled or interrupted ({exc_type.__name__})")

    def has_room(self) -> bool:
        return len(self.running) < self.sweep.concurrency


    # ------------------------------------------------------------------------------------------- start and follow
    def start(self, trial: optuna.Trial) -> None:
        """A flow run of the training deployment with the trial's config, named '<sweep>-t<number>', and what the
        sweep was told of where trials run (`deploy`: merged over the deployment's own by the flow run)."""
        cfg = trial_config(self.config, self.sweep, trial.number, trial.params, self.parent.run_id)
        trial.set_user_attr("run_name", cfg.run_name)
        deployment = self.deployment(cfg)
        try:
            run = run_deployment(deployment, parameters=self.parameters(cfg), timeout=0,
                                 flow_run_name=cfg.run_name, tags=[f"sweep-{self.sweep.name}"])
        except Exception as exc:  # noqa: BLE001 - the trial fails, the sweep goes on
            self._tell(trial, TrialState.FAIL, reason=f"could not start a run of {deployment}: {first_line(exc)}")
            return
        trial.set_user_attr("flow_run_id", str(run.id))
        self.running[trial.number] = Running(trial, run.id, cfg.run_name)
        self.logger.info(f"trial {trial.number} started: {cfg.run_name} ({_show(trial.params)}), flow run {run.id} "
                         f"of {deployment}")

    def follow(self, unfinished: list[FrozenTrial]) -> None:
        """Trials an earlier run of this sweep started and never saw end: their flow runs are followed to the end."""
        for frozen in unfinished:
            trial = optuna.trial.Trial(self.study, frozen._trial_id)  # Optuna's handle of a trial by its storage id
            flow_run_id = frozen.user_attrs.get("flow_run_id")
            if flow_run_id is None:  # it died before creating the flow run, or before recording its id
                flow_run_id = self._flow_run_named(frozen.user_attrs.get("run_name"))
                if flow_run_id is None:
                    self._tell(trial, TrialState.FAIL, reason="a run of the sweep stopped before starting its flow run")
                    continue
                trial.set_user_attr("flow_run_id", str(flow_run_id))
            running = Running(trial, UUID(str(flow_run_id)), frozen.user_attrs["run_name"],
                              frozen.user_attrs.get("mlflow_run_id"), dict(frozen.intermediate_values))
            self.running[frozen.number] = running
            self.logger.info(f"trial {frozen.number} ({running.run_name}) was left running by an earlier run of the "
                             f"sweep: following its flow run {running.flow_run_id}")

    def _flow_run_named(self, run_name: Optional[str]) -> Optional[UUID]:
        """The flow run `start` created for a trial under its name (the trial's run name, tagged with the sweep), if
        the Prefect API has one: a run of the sweep killed right after creating it never recorded its id, and it
        runs all the same."""
        if not run_name:
            return None
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=[run_name]), tags=FlowRunFilterTags(all_=[f"sweep-{self.sweep.name}"])))
        return max(runs, key=lambda run: run.created).id if runs else None

    def followed(self) -> list[optuna.Trial]:
        return [r.trial for r in self.running.values()]

    # ------------------------------------------------------------------------------------------- follow them
    def poll(self) -> None:
        """After `sweep.poll_s`: every running trial's state and new metric steps; prune; tell the ones that ended.
        A failed reading (Prefect or MLflow unreachable for a moment) is tried again at the next poll; the sweep
        fails after MAX_POLL_ERRORS in a row."""
        time.sleep(self.sweep.poll_s)
        try:
            with get_client(sync_client=True) as client:
                states = {number: client.read_flow_run(r.flow_run_id).state for number, r in self.running.items()}
            for number, state in states.items():
                running = self.running[number]
                ended = state is not None and state.is_final()
                self._report(running, judge=not ended)
                if ended:
                    self._end(running, state)
            self.errors = 0
        except Exception as exc:
            self.errors += 1
            if self.errors >= MAX_POLL_ERRORS:
                raise
            self.logger.warning(f"could not read the trials ({self.errors} time(s) in a row), trying again: "
                                f"{first_line(exc)}")

    def _report(self, r: Running, judge: bool) -> None:
        """New steps of the metric -> Optuna; then ask the pruner (`judge`: not for a flow run that has ended)."""
        if r.pruned is not None:
            return
        if r.mlflow_run_id is None and (run_id := self.parent.trial_run_id(r.run_name)):
            r.mlflow_run_id = run_id
            r.trial.set_user_attr("mlflow_run_id", run_id)
        if r.mlflow_run_id is None:
            return
        new = [(step, value) for step, value in self.parent.history(r.mlflow_run_id) if step not in r.reported]
        for step, value in new:  # the pruner is asked at every step, as the trial itself would ask it, however many
            r.trial.report(value, step)  # steps one poll finds
            r.reported[step] = value
            self.logger.info(f"trial {r.trial.number} ({r.run_name}) step {step}: {self.sweep.metric} {value:.4g}")
            if judge and self.sweep.pruner != "none" and r.trial.should_prune():
                self._prune(r, step)
                return

    def _prune(self, r: Running, step: int) -> None:
        best = (max if self.sweep.direction == "maximize" else min)(r.reported.values())
        reason = (f"pruned at step {step}: its best {self.sweep.metric} so far, {best:.4g}, is worse than the median "
                  f"of the completed trials at that step")
        cancel(r.flow_run_id, f"{reason} (sweep {self.sweep.name})")
        r.pruned = self._tell(r.trial, TrialState.PRUNED, reason=reason)

    def _end(self, r: Running, state: State) -> None:
        """The trial's flow run has ended: tell the study (unless pruned) and mark its MLflow run; free the slot."""
        del self.running[r.trial.number]
        if r.mlflow_run_id is None and (run_id := self.parent.trial_run_id(r.run_name)):
            r.mlflow_run_id = run_id
            if r.pruned is None:
                r.trial.set_user_attr("mlflow_run_id", run_id)
        if r.pruned is not None:
            frozen = r.pruned
            self.logger.info(f"trial {r.trial.number} ({r.run_name}): flow run {state.name} after pruning")
        elif not state.is_completed():
            frozen = self._tell(r.trial, TrialState.FAIL,
                                reason=f"its flow run ended {state.name}: {state.message or 'no message'}")
        else:
            history = self.parent.history(r.mlflow_run_id) if r.mlflow_run_id else []
            step, value = history[-1] if history else (None, math.nan)
            if not history:
                frozen = self._tell(r.trial, TrialState.FAIL, reason=f"its run logged no {self.sweep.metric}")
            elif not math.isfinite(value):
                frozen = self._tell(r.trial, TrialState.FAIL, reason=f"{self.sweep.metric} is {value} at step {step}")
            else:
                frozen = self._tell(r.trial, TrialState.COMPLETE, value=value)
        if r.mlflow_run_id is not None:
            self.parent.mark_trial(r.mlflow_run_id, frozen)

    def _tell(self, trial: optuna.Trial, state: TrialState, value: Optional[float] = None,
              reason: Optional[str] = None) -> FrozenTrial:
        if reason:
            trial.set_user_attr("reason", reason)
        frozen = self.study.tell(trial, value, state=state)
        outcome = f"{self.sweep.metric} {value:.4g}" if value is not None else reason
        self.logger.info(f"trial {trial.number} {frozen.state.name.lower()}: {outcome}")
        return frozen

    def stop_all(self, reason: str) -> None:
        """Cancel every trial still running and tell the study FAIL (a rerun of the sweep runs them again)."""
        for r in list(self.running.values()):
            try:
                cancel(r.flow_run_id, reason)
            except Exception as exc:  # noqa: BLE001 - best effort: the API may be going away with us
                self.logger.warning(f"could not cancel flow run {r.flow_run_id} of trial {r.trial.number}: {exc}")
            if r.pruned is None:
                self._tell(r.trial, TrialState.FAIL, reason=reason)
        self.running.clear()


def _show(params: dict) -> str:
    return ", ".join(f"{field}={value}" for field, value in params.items())
