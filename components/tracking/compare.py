"""Compare training runs from MLflow: one figure (metric vs iteration and vs wall-clock) and a markdown table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

from matplotlib.figure import Figure
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from components.tracking.tracker import TrackingError, get_or_create_experiment
from models.algorithms import ALGORITHMS

DEFAULT_METRICS = ("objective/gold_reward", "reward", "objective/kl", "objective/entropy", "step_time")
# the held-out eval (eval.*): plotted below the training curves when a run has it
EVAL_METRICS = ("eval/gold_reward", "eval/reward", "eval/accuracy")


@dataclass
class _Series:
    """One run's histories: metric -> [(step, seconds since run start, value)] sorted by step."""

    run: Run
    points: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)
    name: str | None = None  # the legend's label; default '<run name> (<algorithm>)'

    @property
    def label(self) -> str:
        return self.name or f"{self.run.info.run_name} ({self.run.data.tags.get('algorithm', '?')})"

    def wall_clock(self) -> float | None:
        info = self.run.info
        if info.end_time:
            return (info.end_time - info.start_time) / 1000
        seconds = [t for pts in self.points.values() for _, t, _ in pts]
        return max(seconds) if seconds else None


def _select_runs(client: MlflowClient, experiment: str, run_ids: list[str] | None, tracking_uri: str) -> list[Run]:
    if run_ids:
        return [client.get_run(run_id) for run_id in run_ids]
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise TrackingError(f"experiment '{experiment}' does not exist at {tracking_uri}")
    runs = []
    for algorithm in ALGORITHMS:
        runs += client.search_runs(
            [found.experiment_id],
            filter_string=f"tags.algorithm = '{algorithm}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
    if not runs:
        raise TrackingError(f"no finished {'/'.join(ALGORITHMS)} runs (tag 'algorithm') in experiment '{experiment}' "
                            f"at {tracking_uri}")
    return runs


def _fmt(value: float | None) -> str:
    return "absent" if value is None else f"{value:.4g}"


def compare_runs(
    tracking_uri: str,
    experiment: str,
    run_ids: list[str] | None,
    out_dir: Path,
    metrics: tuple[str, ...] = DEFAULT_METRICS,
    labels: dict[str, str] | None = None,
    statistics: Callable[[list[str]], str] | None = None,
) -> tuple[Path, Path]:
    """Write comparison.png and comparison.md for `run_ids` (default: latest finished run per algorithm): `metrics`,
    then the eval curves (EVAL_METRICS) that any of the runs logged. `labels`: run id -> its name in the legend and
    the table (e.g. a sweep's trial with its values). `statistics(run ids)`: markdown appended to the table (`rlhf
    compare`'s: the runs as an experiment's arms of one seed, components/sweep/report.one_seed_per_arm)."""
    client = MlflowClient(tracking_uri)
    series = []
    for run in _select_runs(client, experiment, run_ids, tracking_uri):
        s = _Series(run, name=(labels or {}).get(run.info.run_id))
        for key in (*metrics, *EVAL_METRICS):
            history = client.get_metric_history(run.info.run_id, key)
            if history:
                s.points[key] = sorted((m.step, (m.timestamp - run.info.start_time) / 1000, m.value) for m in history)
        series.append(s)

    training = metrics
    metrics = (*metrics, *(k for k in EVAL_METRICS if k not in metrics and any(k in s.points for s in series)))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png, md = out_dir / "comparison.png", out_dir / "comparison.md"

    fig = Figure(figsize=(12, 2.8 * len(metrics)), layout="constrained")
    axes = fig.subplots(len(metrics), 2, squeeze=False)
    for row, key in enumerate(metrics):
        by_step, by_time = axes[row]
        absent = [s.label for s in series if key not in s.points]
        for s in series:
            if key in s.points:
                steps, seconds, values = zip(*s.points[key])
                by_step.plot(steps, values, label=s.label)
                by_time.plot(seconds, values, label=s.label)
        note = f"  (absent: {', '.join(absent)})" if absent else ""
        by_step.set_title(f"{key} vs iteration{note}", fontsize=9)
        by_time.set_title(f"{key} vs wall-clock{note}", fontsize=9)
        by_step.set_xlabel("iteration")
        by_time.set_xlabel("seconds since run start")
        for ax in (by_step, by_time):
            ax.set_ylabel(key, fontsize=8)
            ax.grid(alpha=0.3)
            if len(absent) < len(series):
                ax.legend(fontsize=8)
    fig.savefig(png, dpi=90)

    header = ["run", "run id", "algorithm", "iterations", *(f"final {k}" for k in metrics), "wall-clock (s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in series:
        steps = {step for key in training if key in s.points for step, _, _ in s.points[key]}
        finals = [_fmt(s.points[k][-1][2]) if k in s.points else "absent" for k in metrics]
        cells = [s.name or s.run.info.run_name, s.run.info.run_id, s.run.data.tags.get("algorithm", "?"),
                 str(len(steps)), *finals]
        lines.append("| " + " | ".join([*cells, _fmt(s.wall_clock())]) + " |")
    stats = statistics([s.run.info.run_id for s in series]) if statistics else ""
    md.write_text(f"# Run comparison: {experiment}\n\n![comparison](comparison.png)\n\n" + "\n".join(lines) + "\n"
                  + stats)
    return png, md


def log_comparison(tracking_uri: str, experiment: str, png: Path, md: Path) -> str:
    """Store the comparison as a FINISHED run named "compare" (tag kind=comparison); return its id."""
    client = MlflowClient(tracking_uri)
    experiment_id = get_or_create_experiment(client, experiment, tracking_uri)
    run = client.create_run(experiment_id, run_name="compare", tags={"kind": "comparison"})
    client.log_artifact(run.info.run_id, str(png))
    client.log_artifact(run.info.run_id, str(md))
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id
