"""PPO as a Prefect flow (`ppo/default`): the actor trains against a critic server (values, and rewards when the reward
model is combined). The algorithm is models/algorithms/ppo.py; the frame is flows/training.py."""

from __future__ import annotations

from prefect import flow

from components.tracking.run import flow_run_namer, named_after_flow_run
from flows.training import train
from models.config import RLHFConfig


@flow(name="ppo", flow_run_name=flow_run_namer("ppo"))  # the flow run is named after its run
def ppo(config: RLHFConfig = RLHFConfig(algorithm="ppo")) -> dict:
    """Train the actor with PPO against a critic server (values, and rewards when the reward model is combined)."""
    return train(named_after_flow_run(config, "ppo"))
