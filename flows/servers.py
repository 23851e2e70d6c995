"""critic-server/default, reward-server/default (PyTriton) and rollout-server/default (vLLM): a server as a Prefect flow
run (its own work pool/node).

The flow starts the server as a child process with the run's secret (read from the Prefect Secret block the run names
in `secret_block`: the parameter is the block's name, never the secret), waits until it is ready, publishes its
address (a Prefect variable named after this flow run) for the PPO/REINFORCE flow that started it, and serves until
that flow cancels it, or until that run is gone: the lease the run holds for this server in its store (`lease`:
components/serving/services.server_lease) is gone, or its flow run (`training_flow_run_id`) ended, was cancelled or
crashed. Then the server is stopped within a bounded time (services.LEASE_TIMEOUT_S on S3, at once locally).
"""

from __future__ import annotations

from typing import Optional

from prefect import flow

from components.serving.services import host_server
from models.config import RLHFConfig


@flow(name="critic-server")
def critic_server(config: RLHFConfig = RLHFConfig(), checkpoint_uri: Optional[str] = None,
                  restore_iteration: Optional[int] = None, secret_block: Optional[str] = None,
                  training_flow_run_id: Optional[str] = None, lease: Optional[str] = None) -> int:
    """Serve critic_infer / critic_train / critic_save for one training run until cancelled. Saves are uploaded to
    the run's checkpoint store (`checkpoint_uri`), where the run's checkpoints adopt them; `restore_iteration` starts
    the critic from iter_<N>/critic there."""
    return host_server("critic", config, checkpoint_uri, restore_iteration, secret_block, training_flow_run_id,
                       lease=lease)


@flow(name="reward-server")
def reward_server(config: RLHFConfig = RLHFConfig(algorithm="rloo"), secret_block: Optional[str] = None,
                  training_flow_run_id: Optional[str] = None, lease: Optional[str] = None) -> int:
    """Serve reward_model until cancelled."""
    return host_server("reward", config, secret_block=secret_block, training_flow_run_id=training_flow_run_id,
                       lease=lease)


@flow(name="rollout-server")
def rollout_server(config: RLHFConfig = RLHFConfig(), secret_block: Optional[str] = None,
                   training_flow_run_id: Optional[str] = None, trainer_host: Optional[str] = None,
                   lease: Optional[str] = None) -> int:
    """Serve the vLLM rollout server (generate, update_weights) for one training run until cancelled; the run sends
    it the actor's weights before its first rollout and after every update, from `trainer_host`."""
    return host_server("rollout", config, secret_block=secret_block, training_flow_run_id=training_flow_run_id,
                       trainer_host=trainer_host, lease=lease)
