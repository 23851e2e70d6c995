"""REINFORCE/RLOO as a Prefect flow (`reinforce/default`): k rollouts per prompt scored by a reward server, a
leave-one-out baseline (or GRPO / REINFORCE++), no critic. The algorithm is models/algorithms/rloo.py; the run is
components/runs.py."""

from __future__ import annotations

from prefect import flow

from components.tasks import flow_run_namer, train_flow
from models.config import RunConfig
from models.deploy import DeployConfig


@flow(name="reinforce", flow_run_name=flow_run_namer("rloo"))  # the flow run is named after its run
def reinforce(config: RunConfig = RunConfig(algorithm="rloo"), deploy: DeployConfig = DeployConfig()) -> dict:
    """Train the actor with RLOO: k rollouts per prompt scored by the reward server, leave-one-out baseline.
    `config`: what the run trains; `deploy`: where its parts run. Each is deep-merged over the deployment's own."""
    return train_flow("rloo", config, deploy)
