"""compare/default: curves of PPO vs RLOO runs from MLflow, as a PNG + markdown table (MLflow and Prefect artifacts)."""

from __future__ import annotations

import base64
from pathlib import Path

from mlflow.tracking import MlflowClient
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from components.sweep.report import one_seed_per_arm
from components.tracking.compare import compare_runs, log_comparison
from components.tracking.run import default_tracking_uri
from models.config import RLHFConfig


@flow(name="compare", log_prints=True)
def compare(experiment: str = "rlhf-flows", run_ids: list[str] | None = None, tracking_uri: str | None = None) -> dict:
    """Compare the chosen runs (default: the latest finished PPO and RLOO runs of the experiment)."""
    uri = tracking_uri or default_tracking_uri(RLHFConfig())
    cfg = RLHFConfig()
    out = cfg.resolved_state_dir() / "compare"
    png, md = compare_runs(uri, experiment, run_ids, out,
                           statistics=lambda ids: one_seed_per_arm(MlflowClient(uri), ids))  # an experiment's code
    run_id = log_comparison(uri, experiment, png, md)
    image = base64.b64encode(Path(png).read_bytes()).decode()
    create_markdown_artifact(key="comparison", markdown=Path(md).read_text()
                             + f"\n\n![comparison](data:image/png;base64,{image})\n",
                             description="PPO vs RLOO: gold reward, RM score, KL, entropy, step time")
    get_run_logger().info(f"comparison written to {png} and {md}; MLflow run {run_id}")
    return {"png": str(png), "markdown": str(md), "mlflow_run_id": run_id}
