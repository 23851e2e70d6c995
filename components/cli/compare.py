"""`rlhf compare`: the latest PPO and RLOO runs (or the runs named) from MLflow, as a PNG and a table; with
`--sweep NAME`, every trial of that sweep (logged on the sweep's parent run)."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from components.sweep.report import one_seed_per_arm
from components.sweep.tracking import compare_trials, find_sweep
from components.tracking.compare import compare_runs, log_comparison
from components.tracking.run import default_tracking_uri
from models.config import RLHFConfig


def cmd_compare(args) -> int:
    uri = args.tracking_uri or default_tracking_uri(RLHFConfig())
    if args.sweep:
        return compare_sweep(uri, args.experiment, args.sweep, Path(args.out) / f"sweep-{args.sweep}")
    png, md = compare_runs(uri, args.experiment, args.runs or None, Path(args.out),
                           statistics=lambda run_ids: one_seed_per_arm(MlflowClient(uri), run_ids))
    run_id = log_comparison(uri, args.experiment, png, md)
    print(Path(md).read_text())
    print(f"wrote {png} and {md}; logged to MLflow run {run_id} at {uri}")
    return 0


def compare_sweep(uri: str, experiment: str, name: str, out: Path) -> int:
    client = MlflowClient(uri)
    try:
        experiment_id, parent_run_id, sweep = find_sweep(client, experiment, name, uri)
    except LookupError as exc:
        raise SystemExit(str(exc)) from None
    found = compare_trials(client, uri, experiment_id, parent_run_id, sweep, out)
    if found is None:
        raise SystemExit(f"sweep '{name}' has no trial run yet")
    png, md = found
    print(Path(md).read_text())
    print(f"wrote {png} and {md}; logged to the sweep's MLflow run {parent_run_id} (comparison/) at {uri}")
    return 0
