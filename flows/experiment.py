"""An experiment as a Prefect flow (`experiment/default`, and `rlhf experiment` in one shell): arms x paired seeds,
each arm x seed a run of its algorithm's training deployment, run as a sweep's grid is (flows/sweep.py: at most
`concurrency` at once, nested under one MLflow run, a finished run never run again, a killed experiment resumed by
rerunning its name), then compared with interval estimates (rliable) in a generated report.

    check the experiment (bad input fails here, before any run starts)
    run the grid of seed x arm as a sweep's trials
    read the runs back from MLflow; the statistics over the seeds every arm completed; the report, its figures and
        experiment.json on the parent run and as the Prefect artifact experiment-<name>
"""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path
from typing import Optional

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from components.environment import quiet
from components.sweep.experiment import ExperimentConfig, check_experiment
from components.sweep.report import build, log_report
from components.sweep.tracking import SweepRun
from flows.sweep import run_sweep
from models.deploy import DeployConfig

# the deployment's defaults: RLOO against GRPO on the shipped task, 3 paired seeds, a held-out eval every 4 iterations
EXAMPLE_EXPERIMENT = ExperimentConfig(
    name="rloo-vs-grpo",
    base={"preset": "tiny", "algorithm": "rloo", "iterations": 12,
          "eval": {"prompts": "builtin:sentiment", "every": 4}},
    arms={"rloo": {}, "grpo": {"algorithm": "grpo"}}, seeds=3, concurrency=2)


def experiment_name() -> str:
    """The experiment's flow run is named after the experiment."""
    experiment = flow_run.get_parameters().get("experiment")
    return (experiment.name if isinstance(experiment, ExperimentConfig)
            else str((experiment or {}).get("name", "experiment")))


@flow(name="experiment", log_prints=True, flow_run_name=experiment_name)
def experiment_flow(experiment: ExperimentConfig = EXAMPLE_EXPERIMENT, deploy: DeployConfig = DeployConfig(),
                    summary_out: Optional[str] = None) -> dict:
    """Run every arm x seed of `experiment` (its `base` and `arms` as `rlhf train --config` takes a config), then
    its statistics and report; returns the summary (runs, statistics per arm and metric; `summary_out`: also written
    there as JSON). `deploy`: where the experiment records and its runs run, merged over each training
    deployment's own."""
    given_deploy = deploy.model_dump(mode="json", exclude_unset=True)
    config = experiment.base_config(given_deploy)
    sweep = check_experiment(config, experiment)  # bad input fails here, before any run starts
    swept = run_sweep(config, sweep, given_deploy, tags={"experiment": experiment.name})
    with SweepRun.open(config, sweep) as parent:  # the same parent run, found again by its tags
        result, md, page, images = build(parent.client, parent.uri, parent.experiment_id, parent.run_id, experiment,
                                         config)
        log_report(parent.client, parent.run_id, experiment, result, md, page, images)
    inline = "".join(f"\n\n![{name}](data:image/png;base64,{base64.b64encode(png).decode()})"
                     for name, png in images.items())
    create_markdown_artifact(key=f"experiment-{experiment.name}", markdown=md + inline,
                             description=f"Experiment {experiment.name}: {len(result['arms'])} arms x "
                                         f"{len(result['seeds'])} paired seeds; {swept['summary']}")
    result = {**result, "mlflow_run_id": parent.run_id, "runs_summary": swept["summary"]}
    if summary_out:
        Path(summary_out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":  # what `rlhf experiment` runs: the flow in this process, its runs on the deployments
    quiet()
    parser = argparse.ArgumentParser(description="Run an experiment flow (rlhf experiment): --experiment as JSON.")
    parser.add_argument("--experiment", required=True, help="the experiment (JSON)")
    parser.add_argument("--deploy", default="{}", help="where the experiment records and its runs run (JSON, partial)")
    parser.add_argument("--summary-out", default=None, help="also write the summary there (JSON)")
    args = parser.parse_args()
    out = experiment_flow(experiment=ExperimentConfig.model_validate(json.loads(args.experiment)),
                          deploy=DeployConfig.model_validate(json.loads(args.deploy)), summary_out=args.summary_out)
    print(json.dumps({k: out[k] for k in ("experiment", "arms", "seeds", "mlflow_run_id", "runs_summary")}, indent=1))
