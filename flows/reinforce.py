"""REINFORCE/RLOO as a Prefect flow (`reinforce/default`): k rollouts per prompt scored by a reward server, a
leave-one-out baseline (or GRPO / REINFORCE++), no critic. The algorithm is models/algorithms/rloo.py; the frame is
flows/training.py."""

from __future__ import annotations

from prefect import flow

from components.tracking.run import flow_run_namer, named_after_flow_run
from flows.training import train
from models.config import RLHFConfig


@flow(name="reinforce", flow_run_name=flow_run_namer("rloo"))  # the flow run is named after its run
def reinforce(config: RLHFConfig = RLHFConfig(algorithm="rloo")) -> dict:
    """Train the actor with RLOO: k rollouts per prompt scored by the reward server, leave-one-out baseline."""
    return train(named_after_flow_run(config, "rloo"))
