"""critic-server/default and reward-server/default: a PyTriton server as a Prefect flow run (its own work pool/node).

The flow starts the server as a child process, waits until it is ready, publishes its address (a Prefect variable named
after this flow run) for the PPO/REINFORCE flow that started it, and serves until that flow cancels it.
"""

from __future__ import annotations

from typing import Optional

from prefect import flow

from models.config import RLHFConfig


@flow(name="critic-server", log_prints=True)
def critic_server(config: RLHFConfig = RLHFConfig(), checkpoint_dir: Optional[str] = None,
                  checkpoint_uri: Optional[str] = None) -> int:
    """Serve critic_infer / critic_train / critic_save for one training run until cancelled (saves also go to the
    run's checkpoint store at `checkpoint_uri`/critic-server, where a fresh node restores from)."""
    from components.remote import host_server

    return host_server("critic", config, checkpoint_dir, checkpoint_uri)


@flow(name="reward-server", log_prints=True)
def reward_server(config: RLHFConfig = RLHFConfig(algorithm="rloo")) -> int:
    """Serve reward_model until cancelled."""
    from components.remote import host_server

    return host_server("reward", config, None)
