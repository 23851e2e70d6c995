"""The critic-free recipes as a Prefect flow (`reinforce/default`): k rollouts per prompt scored by a reward server,
RLOO by default, any other critic-free recipe by `config.algorithm` (grpo, dr_grpo, dapo, gspo, cispo, reinforce_pp,
opd: models/algorithms/recipes.py). The step is models/algorithms/group.py; the run is components/runs.py."""

from __future__ import annotations

from prefect import flow

from components.tasks import flow_run_namer, train_flow
from models.config import RunConfig
from models.deploy import DeployConfig


@flow(name="reinforce", flow_run_name=flow_run_namer("rloo"))  # the flow run is named after its run
def reinforce(config: RunConfig = RunConfig(algorithm="rloo"), deploy: DeployConfig = DeployConfig()) -> dict:
    """Train the actor with a critic-free recipe (RLOO unless config.algorithm names another): k rollouts per prompt
    scored by the reward server.
    `config`: what the run trains; `deploy`: where its parts run. Each is deep-merged over the deployment's own."""
    return train_flow("rloo", config, deploy)
