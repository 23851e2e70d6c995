"""PPO as a Prefect flow (`ppo/default`): the actor trains against a critic server (values, and rewards when the reward
model is combined). The step is models/algorithms/ppo.py (its loss: the `loss` menu); the run is components/runs.py."""

from __future__ import annotations

from prefect import flow

from components.tasks import flow_run_namer, train_flow
from models.config import RunConfig
from models.deploy import DeployConfig


@flow(name="ppo", flow_run_name=flow_run_namer("ppo"))  # the flow run is named after its run
def ppo(config: RunConfig = RunConfig(algorithm="ppo"), deploy: DeployConfig = DeployConfig()) -> dict:
    """Train the actor with PPO against a critic server (values, and rewards when the reward model is combined).
    `config`: what the run trains; `deploy`: where its parts run. Each is deep-merged over the deployment's own."""
    return train_flow("ppo", config, deploy)
