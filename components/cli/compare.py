"""`rlhf compare`: the latest PPO and RLOO runs (or the runs named) from MLflow, as a PNG and a table."""

from __future__ import annotations

from pathlib import Path

from components.tracking.compare import compare_runs, log_comparison
from components.tracking.run import default_tracking_uri
from models.config import RLHFConfig


def cmd_compare(args) -> int:
    uri = args.tracking_uri or default_tracking_uri(RLHFConfig())
    png, md = compare_runs(uri, args.experiment, args.runs or None, Path(args.out))
    run_id = log_comparison(uri, args.experiment, png, md)
    print(Path(md).read_text())
    print(f"wrote {png} and {md}; logged to MLflow run {run_id} at {uri}")
    return 0
