"""A hyperparameter sweep as a Prefect flow (`sweep/default`, and `rlhf sweep` in one shell): an Optuna study whose
trials are runs of the algorithm's training deployment (ppo/default or reinforce/default), at most
`sweep.concurrency` at a time, pruned by the study's pruner, all nested under one MLflow run named after the sweep.

    check the space against the config (bad input fails here, before any trial starts)
    open the study (rerunning a name resumes it) and the MLflow parent run
    follow the trials an earlier, dead run of this sweep left running
    while trials are left or running: start trials while a slot is free; read their states and metrics (report,
        prune, tell the ones that ended)
    record the table of trials, the best trial, the plots and the comparison; fail only if every trial failed
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

from prefect import flow
from prefect.runtime import flow_run

from components.environment import quiet
from components.pipeline.config import PipelineConfig
from components.sweep.config import SweepConfig
from components.sweep.space import SweepError, check_sweep
from components.sweep.study import Plan, open_study, unfinished
from components.sweep.tracking import SweepRun, table_artifact
from components.sweep.trials import Trials, require_deployment
from models.algorithms import ALGORITHMS
from models.config import RLHFConfig, RunConfig, merge
from models.deploy import DeployConfig

# the deployment that trains each algorithm: the flows of flows/ppo.py and flows/reinforce.py, served as 'default'
# (named, not imported: the sweep's flow run loads no model code; tests/flows/test_sweeps.py checks the names); every
# critic-free recipe runs on reinforce/default
TRAINING_DEPLOYMENTS = {name: "ppo/default" if algorithm.needs_critic else "reinforce/default"
                        for name, algorithm in ALGORITHMS.items()}
PIPELINE_DEPLOYMENT = "pipeline/default"  # flows/stages.py: a pipeline's trials

# the deployment's defaults: RLOO on the tiny preset with a held-out eval every 4 iterations, a 2 x 2 grid over the
# learning rate and the initial KL coefficient (`prefect deployment run sweep/default` runs it; any parameter can be
# replaced)
EXAMPLE_CONFIG = RunConfig(preset="tiny", algorithm="rloo", eval={"prompts": "builtin:sentiment", "every": 4})
EXAMPLE_SWEEP = SweepConfig(name="rloo-lr-kl", space={"reinforce.optim.lr": [1e-6, 1e-3], "kl.beta": [0.01, 0.1]},
                            concurrency=2)


def sweep_name() -> str:
    """The sweep's flow run is named after the sweep."""
    sweep = flow_run.get_parameters().get("sweep")
    return sweep.name if isinstance(sweep, SweepConfig) else str((sweep or {}).get("name", "sweep"))


@flow(name="sweep", log_prints=True, flow_run_name=sweep_name)
def sweep_flow(config: RunConfig = EXAMPLE_CONFIG, sweep: SweepConfig = EXAMPLE_SWEEP,
               deploy: DeployConfig = DeployConfig(), pipeline: Optional[PipelineConfig] = None) -> dict:
    """Search `sweep.space` over the base `config`: every trial is a run of the training deployment of
    `config.algorithm`, named '<sweep>-t<N>'; returns the summary (counts, best trial). `deploy`: where the sweep
    records (its state directory, the MLflow server); what of it was given is also given to every trial, merged
    over the training deployment's own (e.g. `{"reward": {"launch": "in_process"}}`: trials without a reward server).
    With a `pipeline`, the space is over its RL stage (`config` is then its rl section) and every trial is a run of
    pipeline/default named '<sweep>-t<N>': the trials reuse its cached sft and reward-model stages (built once, by
    whichever trial gets there first), and the metric is read from each pipeline's run (its RL stage's held-out evals
    by iteration, the eval stage's metrics at step 0)."""
    given_deploy = deploy.model_dump(mode="json", exclude_unset=True)
    if pipeline is not None:
        try:
            pipeline.check_rl_stage("a pipeline sweep varies")
        except ValueError as exc:
            raise SweepError(str(exc)) from None
        config = merge(pipeline.rl, {"tracking.experiment": pipeline.tracking.experiment})
    summary = run_sweep(RLHFConfig.of(config, deploy), sweep, given_deploy, pipeline)
    return {k: v for k, v in summary.items() if k != "rows"}


def run_sweep(config: RLHFConfig, sweep: SweepConfig, given_deploy: dict, pipeline: Optional[PipelineConfig] = None,
              tags: Optional[dict] = None) -> dict:
    """The sweep's body (also an experiment's, flows/experiment.py): check, open the study and the parent run, run
    and follow the trials, record; returns the summary with the rows of the table. `given_deploy`: what the flow run
    was told of where trials run, given to each; `tags`: more tags on the parent run."""
    space = check_sweep(config, sweep, pipeline=pipeline is not None)  # bad input fails here, before any trial starts
    if pipeline is None:
        # ppo/default or reinforce/default (an arm may set its own), which must exist
        for algorithm in space.algorithms:
            training_deployment(algorithm)

        def deployment(cfg):
            return TRAINING_DEPLOYMENTS[cfg.algorithm]

        def parameters(cfg):
            return {"config": cfg.run.model_dump(mode="json"), **({"deploy": given_deploy} if given_deploy else {})}
    else:
        require_deployment(PIPELINE_DEPLOYMENT)

        def deployment(cfg):
            return PIPELINE_DEPLOYMENT

        def parameters(cfg):
            return pipeline_trial(pipeline, cfg, given_deploy)
    study = open_study(config, sweep, space)  # created, or resumed by name: its finished trials are kept
    with SweepRun.open(config, sweep, {"prefect.flow_run_id": flow_run.get_id(), **(tags or {})}) as parent, \
            Trials(config, sweep, space, study, parent, deployment, parameters) as trials:  # on failure: cancelled
        trials.follow(unfinished(study))  # left running by an earlier run of this sweep that died
        plan = Plan(study, space, sweep, trials.followed())  # the combinations (or the count) still to run
        while plan or trials.running:
            while plan and trials.has_room():  # at most sweep.concurrency at once
                trials.start(plan.ask())  # a flow run of the deployment, a child of this one
            trials.poll()  # states and metric steps -> Optuna; prune (cancel); tell the ones that ended
        summary = parent.record(study)  # table, best trial, plots, comparison on the parent run
        table_artifact(sweep, summary)
        if summary["complete"] + summary["pruned"] == 0 and summary["failed"]:
            raise RuntimeError(f"every trial of sweep {sweep.name} failed; {summary['summary']}")
    return summary


def pipeline_trial(pipeline: PipelineConfig, cfg: RLHFConfig, deploy: dict) -> dict:
    """The parameters of a pipeline trial: the pipeline named after the trial, nested under the sweep's run, with the
    trial's config as its RL stage (and what the sweep was told of where trials run)."""
    trial = merge(pipeline, {"rl": cfg.run.model_dump(mode="json"), "name": cfg.run_name,
                             "tracking.parent_run_id": cfg.tracking.parent_run_id})
    return {"config": trial.model_dump(mode="json"), **({"deploy": deploy} if deploy else {})}


def training_deployment(algorithm: str) -> str:
    """The deployment that runs the trials of `algorithm`; it must be served."""
    if algorithm not in TRAINING_DEPLOYMENTS:
        raise SweepError(f"config.algorithm: {algorithm} has no training deployment "
                         f"(known: {', '.join(TRAINING_DEPLOYMENTS)})")
    require_deployment(TRAINING_DEPLOYMENTS[algorithm])
    return TRAINING_DEPLOYMENTS[algorithm]


if __name__ == "__main__":  # what `rlhf sweep` runs: the flow in this process, its trials on the deployments
    quiet()
    parser = argparse.ArgumentParser(description="Run a sweep flow (rlhf sweep): --config and --sweep as JSON.")
    parser.add_argument("--config", required=True, help="the base run config (JSON)")
    parser.add_argument("--deploy", default="{}", help="where the sweep records and its trials run (JSON, partial)")
    parser.add_argument("--sweep", required=True, help="the sweep section (JSON)")
    parser.add_argument("--pipeline", help="a pipeline whose RL stage the trials vary (JSON)")
    args = parser.parse_args()
    result = sweep_flow(config=RunConfig.model_validate(json.loads(args.config)),
                        sweep=SweepConfig.model_validate(json.loads(args.sweep)),
                        deploy=DeployConfig.model_validate(json.loads(args.deploy)),
                        pipeline=PipelineConfig.model_validate_json(args.pipeline) if args.pipeline else None)
    print(json.dumps(result, indent=1, default=str))
