"""REINFORCE/RLOO as a Prefect flow (`reinforce/default`): k rollouts per prompt scored by a reward server, a
leave-one-out baseline (or GRPO / REINFORCE++), no critic. The algorithm is models/algorithms/rloo.py; the frame is
flows/training.py."""

from __future__ import annotations

from prefect import flow

from flows.training import train
from models.config import RLHFConfig


@flow(name="reinforce")
def reinforce(config: RLHFConfig = RLHFConfig(algorithm="rloo")) -> dict:
    """Train the actor with RLOO: k rollouts per prompt scored by the reward server, leave-one-out baseline."""
    return train(config.model_copy(update={"algorithm": "rloo"}))
