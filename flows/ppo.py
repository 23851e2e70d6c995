"""PPO as a Prefect flow (`ppo/default`): the actor trains against a critic server (values, and rewards when the reward
model is combined). The algorithm is models/algorithms/ppo.py; the frame is flows/training.py."""

from __future__ import annotations

from prefect import flow

from flows.training import train
from models.config import RLHFConfig


@flow(name="ppo")
def ppo(config: RLHFConfig = RLHFConfig(algorithm="ppo")) -> dict:
    """Train the actor with PPO against a critic server (values, and rewards when the reward model is combined)."""
    return train(config.model_copy(update={"algorithm": "ppo"}))
