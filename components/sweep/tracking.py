"""What a sweep records: its MLflow parent run (the trials nest under it through their `tracking.parent_run_id`), the
trials' states on their runs, and at the end the table of trials, the best trial, Optuna's plots and a comparison of
every trial's curves on the parent run, plus the Prefect table artifact `sweep-<name>`.

The parent run is found again by its tags (kind=sweep, sweep=<name>), so a rerun of the sweep goes on in the same run.
MLflow's table artifact appends rows, so each finished trial is added to trials.json once; the plots, the best trial
(tags best.*, metric sweep/best_value) and the comparison are rewritten at the end of every run of the sweep.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import warnings
from pathlib import Path
from types import TracebackType
from typing import Optional

import matplotlib.pyplot as plt
import optuna
import yaml
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from optuna.trial import FrozenTrial, TrialState
from optuna.visualization import matplotlib as plots
from prefect.artifacts import create_table_artifact

from components.sweep.config import SweepConfig
from components.sweep.study import label
from components.tracking.compare import DEFAULT_METRICS, EVAL_METRICS, compare_runs
from components.tracking.run import default_tracking_uri
from components.tracking.tracker import check_reachable, flatten, get_or_create_experiment, redact
from models.config import RLHFConfig

TABLE = "trials.json"
PLOTS = {  # Optuna's matplotlib plots (name -> draw(study, seed)); the importances by fANOVA (a random forest over the
    # trials, scikit-learn: MLflow's dependency), which reads a handful of grid trials sensibly
    "optimization_history": lambda study, seed: plots.plot_optimization_history(study),
    "parallel_coordinate": lambda study, seed: plots.plot_parallel_coordinate(study),
    "param_importances": lambda study, seed: plots.plot_param_importances(study, _fanova(seed)),
    "intermediate_values": lambda study, seed: plots.plot_intermediate_values(study)}


def _fanova(seed: int):
    """Optuna's fANOVA evaluator, imported when a sweep ends: it pulls in scikit-learn and SciPy (~2.5 s of CPU), which
    every sweep flow run would otherwise pay at its start."""
    from optuna.importance import FanovaImportanceEvaluator  # scikit-learn and SciPy: only when a sweep ends

    return FanovaImportanceEvaluator(seed=seed)


class SweepRun:
    """The sweep's MLflow parent run, and the sweep's reads and writes of its trials' runs."""

    def __init__(self, client: MlflowClient, uri: str, experiment_id: str, run_id: str, sweep: SweepConfig):
        self.client, self.uri, self.experiment_id, self.run_id, self.sweep = client, uri, experiment_id, run_id, sweep

    @classmethod
    def open(cls, config: RLHFConfig, sweep: SweepConfig, tags: Optional[dict] = None) -> "SweepRun":
        """The parent run named after the sweep: found again by its tags, or created with the sweep's definition as
        params and the base config as config.yaml."""
        uri = default_tracking_uri(config)
        check_reachable(uri)
        client = MlflowClient(uri)
        experiment_id = get_or_create_experiment(client, config.tracking.experiment, uri)
        found = client.search_runs([experiment_id], f"tags.kind = 'sweep' and tags.sweep = '{sweep.name}'",
                                   order_by=["attributes.start_time ASC"], max_results=1)
        if found:
            run_id = found[0].info.run_id
            client.update_run(run_id, status="RUNNING")
        else:
            run_id = client.create_run(experiment_id, run_name=sweep.name,
                                       tags={"kind": "sweep", "sweep": sweep.name,
                                             "algorithm": config.algorithm}).info.run_id
            definition = sweep.model_dump(mode="json", include={"space", "arms", "sampler", "seed", "metric",
                                                                  "direction"})
            client.log_batch(run_id, params=[Param(k, v) for k, v in flatten({"sweep": definition}).items()])
            # the study storage URL (and any URL of the config) may hold a password: never logged as it is
            client.log_text(run_id, yaml.safe_dump(redact(config.model_dump(mode="json")), sort_keys=False),
                            "config.yaml")
            client.log_text(run_id, yaml.safe_dump(redact(sweep.model_dump(mode="json")), sort_keys=False),
                            "sweep.yaml")
        settings = {"sweep.concurrency": sweep.concurrency, "sweep.trials": sweep.trials, "sweep.pruner": sweep.pruner,
                    **(tags or {})}
        client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in settings.items()])
        return cls(client, uri, experiment_id, run_id, sweep)

    def __enter__(self) -> "SweepRun":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        status = "FINISHED" if exc_type is None else "KILLED" if not issubclass(exc_type, Exception) else "FAILED"
        self.client.set_terminated(self.run_id, status)

    # ------------------------------------------------------------------------------------------- the trials' runs
    def trial_run_id(self, run_name: str) -> Optional[str]:
        """The MLflow run of a trial once its flow run created it (nested under this run)."""
        runs = self.client.search_runs([self.experiment_id], f"tags.`mlflow.parentRunId` = '{self.run_id}' and "
                                       f"attributes.run_name = '{run_name}'", max_results=1)
        return runs[0].info.run_id if runs else None

    def history(self, run_id: str) -> list[tuple[int, float]]:
        """(step, value) of the sweep's metric in a trial's run, by step (the latest value of a step logged twice)."""
        latest = {}
        for m in sorted(self.client.get_metric_history(run_id, self.sweep.metric), key=lambda m: (m.step, m.timestamp)):
            latest[m.step] = m.value
        return sorted(latest.items())

    def mark_trial(self, run_id: str, trial: FrozenTrial) -> None:
        """The trial's outcome on its run: tags sweep.trial, sweep.state (complete / pruned / failed), sweep.reason,
        sweep.param.<field> (its values: an experiment's arm and seed);
        a pruned run ends KILLED (it was cancelled)."""
        tags = {"sweep.name": self.sweep.name, "sweep.trial": trial.number, "sweep.state": label(trial),
                **{f"sweep.param.{field}": value for field, value in trial.params.items()}}
        if reason := trial.user_attrs.get("reason"):
            tags["sweep.reason"] = reason[:5000]
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        if trial.state == TrialState.PRUNED:
            self.client.set_terminated(run_id, "KILLED")

    # ------------------------------------------------------------------------------------------- the record
    def record(self, study: optuna.Study) -> dict:
        """Table of trials, best trial, plots and comparison on the parent run. Returns a summary: counts, best trial,
        what was logged, and the rows of the table."""
        trials = study.get_trials(deepcopy=False)
        rows = [trial_row(trial, self.sweep) for trial in trials]
        self._append_table([row for row, trial in zip(rows, trials) if trial.state.is_finished()])
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        best = study.best_trial if complete else None
        counts = {name: sum(label(t) == name for t in trials) for name in ("complete", "pruned", "failed")}
        metrics = [Metric(f"sweep/{name}", float(n), int(time.time() * 1000), 0) for name, n in counts.items()]
        if best is not None:
            metrics.append(Metric("sweep/best_value", best.value, int(time.time() * 1000), len(complete)))
            tags = {"best.trial": best.number, "best.value": best.value,
                    "best.run_name": best.user_attrs.get("run_name"),
                    "best.run_id": best.user_attrs.get("mlflow_run_id"),
                    **{f"best.{field}": value for field, value in best.params.items()}}
            self.client.log_batch(self.run_id, metrics=metrics, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        else:
            self.client.log_batch(self.run_id, metrics=metrics)
        drawn = self._log_plots(study, complete)
        compared = self._log_comparison()
        summary = f"{len(trials)} trials: " + ", ".join(f"{n} {name}" for name, n in counts.items())
        if best is not None:
            summary += (f"; best: trial {best.number} ({best.user_attrs.get('run_name')}) {self.sweep.metric} "
                        f"{best.value:.4g}")
        return {"sweep": self.sweep.name, "mlflow_run_id": self.run_id, **counts, "summary": summary,
                "best": None if best is None else {"trial": best.number, "value": best.value, "params": best.params,
                                                    "run_name": best.user_attrs.get("run_name")},
                "plots": drawn, "comparison": compared, "rows": rows}

    def _append_table(self, rows: list[dict]) -> None:
        """Add the rows of trials the table does not have yet (MLflow appends to an existing table artifact)."""
        with tempfile.TemporaryDirectory() as tmp:
            try:
                table = json.loads(Path(self.client.download_artifacts(self.run_id, TABLE, tmp)).read_text())
                logged = {row[table["columns"].index("trial")] for row in table["data"]}
            except (MlflowException, OSError, ValueError, KeyError):
                logged = set()
        new = [row for row in rows if row["trial"] not in logged]
        if new:
            columns = list(dict.fromkeys(key for row in new for key in row))
            self.client.log_table(self.run_id, {c: [row.get(c) for row in new] for c in columns}, TABLE)

    def _log_plots(self, study: optuna.Study, complete: list[FrozenTrial]) -> list[str]:
        """Optuna's plots as PNGs under plots/: the importances need 2 complete trials and a parameter that varies."""
        drawn = []
        if not complete:
            return drawn
        for name, plot in PLOTS.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                try:
                    axes = plot(study, self.sweep.seed)
                except (ValueError, RuntimeError, ZeroDivisionError):  # too few trials for this plot
                    continue
            figure = _figure(axes)
            figure.set_size_inches(9, 5)
            self.client.log_figure(self.run_id, figure, f"plots/{name}.png",
                                   save_kwargs={"dpi": 90, "bbox_inches": "tight"})
            plt.close(figure)  # Optuna draws through pyplot, which keeps every figure until closed
            drawn.append(f"plots/{name}.png")
        return drawn

    def _log_comparison(self) -> Optional[str]:
        with tempfile.TemporaryDirectory() as tmp:
            found = compare_trials(self.client, self.uri, self.experiment_id, self.run_id, self.sweep, Path(tmp))
        return None if found is None else "comparison/comparison.png"


def table_artifact(sweep: SweepConfig, summary: dict) -> None:
    """The table of trials as the Prefect table artifact 'sweep-<name>' (of the sweep's flow run)."""
    create_table_artifact(table=summary["rows"] or [{"trial": "none"}], key=f"sweep-{sweep.name}",
                          description=f"Sweep {sweep.name} ({sweep.metric}, {sweep.direction}): {summary['summary']}")


def trial_row(trial: FrozenTrial, sweep: SweepConfig) -> dict:
    """A row of the trials table: trial, run, state, value, the swept fields, run ids, reason."""
    value = trial.value if trial.value is not None and math.isfinite(trial.value) else None
    return {"trial": trial.number, "run": trial.user_attrs.get("run_name", ""), "state": label(trial), "value": value,
            **{field: trial.params.get(field) for field in sweep.space},
            "mlflow_run_id": trial.user_attrs.get("mlflow_run_id", ""),
            "flow_run_id": trial.user_attrs.get("flow_run_id", ""), "reason": trial.user_attrs.get("reason", "")}


def sweep_metrics(sweep: SweepConfig) -> tuple[str, ...]:
    """The training curves of a comparison, and the sweep's metric (the eval curves come with them by themselves)."""
    extra = () if sweep.metric in (*DEFAULT_METRICS, *EVAL_METRICS) else (sweep.metric,)
    return (*DEFAULT_METRICS, *extra)


def trial_runs(client: MlflowClient, experiment_id: str, parent_run_id: str, sweep: SweepConfig) -> dict[str, str]:
    """run id -> label ('<run name>: field=value ..., <state>') of the trial runs nested under a sweep's parent run,
    by trial number."""
    runs = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'", max_results=1000)
    runs.sort(key=lambda r: int(r.data.tags.get("sweep.trial", 10**9)))
    def describe(run) -> str:
        values = ", ".join(f"{field}={run.data.params.get(field, '?')}" for field in sweep.space)
        return f"{run.info.run_name}: {values}, {run.data.tags.get('sweep.state', run.info.status.lower())}"
    return {run.info.run_id: describe(run) for run in runs}


def compare_trials(client: MlflowClient, uri: str, experiment_id: str, parent_run_id: str, sweep: SweepConfig,
                   out_dir: Path) -> Optional[tuple[Path, Path]]:
    """Every trial's curves side by side (components/tracking/compare.py: comparison.png and comparison.md in
    `out_dir`), also logged on the sweep's parent run under comparison/; None when no trial has a run yet."""
    runs = trial_runs(client, experiment_id, parent_run_id, sweep)
    if not runs:
        return None
    png, md = compare_runs(uri, f"sweep {sweep.name}", list(runs), out_dir, metrics=sweep_metrics(sweep), labels=runs)
    client.log_artifact(parent_run_id, str(png), "comparison")
    client.log_artifact(parent_run_id, str(md), "comparison")
    return png, md


def find_parent(client: MlflowClient, experiment: str, tag: str, name: str, uri: str,
                artifact: str) -> tuple[str, str, dict]:
    """(experiment id, parent run id, the YAML `artifact` on it) of the sweep-kind parent run tagged `tag`=`name` (a
    sweep's: sweep=<name>, sweep.yaml; an experiment's: experiment=<name>, experiment.yaml); LookupError naming what
    is missing."""
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], f"tags.kind = 'sweep' and tags.{tag} = '{name}'",
                              max_results=1) if found else []
    if not runs:
        raise LookupError(f"no {tag} named '{name}' in experiment '{experiment}' at {uri}")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            text = Path(client.download_artifacts(runs[0].info.run_id, artifact, tmp)).read_text()
        except (MlflowException, OSError):
            raise LookupError(f"{tag} '{name}' has no {artifact} on its run {runs[0].info.run_id} yet (it is written "
                              f"when its runs have ended)") from None
    return found.experiment_id, runs[0].info.run_id, yaml.safe_load(text)


def find_sweep(client: MlflowClient, experiment: str, name: str, uri: str) -> tuple[str, str, SweepConfig]:
    """(experiment id, parent run id, the sweep's definition) of the sweep named `name`."""
    experiment_id, run_id, definition = find_parent(client, experiment, "sweep", name, uri, "sweep.yaml")
    return experiment_id, run_id, SweepConfig.model_validate(definition)


def _figure(axes):
    """The figure of what an Optuna matplotlib plot returns (one Axes, or an array of them)."""
    return axes.figure if hasattr(axes, "figure") else axes.flat[0].figure


