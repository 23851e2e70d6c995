"""Where the critic / reward run for a flow: in this process, a local PyTriton child process, or a Prefect deployment.

`critic_service(cfg, session)` and `reward_service(cfg, session)` are context managers: they deploy the server, wait
until it is ready, yield a `Service` (its backend implements models/backends.py), and tear the server down on success,
failure and cancellation (SIGTERM in the flow process raises, so the `finally` runs).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from components.run import RunSession
from models.config import RLHFConfig


class ServerDied(RuntimeError):
    """A critic/reward server went away during the run; the message names it, its exit code and its log tail."""


@dataclass
class Service:
    """A ready backend plus what is needed to explain its failure."""

    name: str
    backend: object
    describe_death: Callable[[], str | None] = lambda: None  # message if the server is gone, else None

    def guard(self, fn, *args, **kwargs):
        """Call a step; if it fails and the server is gone, fail with a message that names the server and its exit."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            death = self.describe_death()
            if death:
                raise ServerDied(death) from exc
            raise


@contextmanager
def critic_service(cfg: RLHFConfig, session: RunSession) -> Iterator[Service]:
    launch = cfg.critic.launch
    if launch == "in_process":
        from models.backends import LocalCritic
        from models.loop import build_critic_trainer

        backend = LocalCritic(build_critic_trainer(cfg, checkpoint_dir=session.critic_dir))
        try:
            yield Service("critic (in process)", backend)
        finally:
            backend.close()
        return
    from components.remote import remote_critic

    with remote_critic(cfg, session) as service:
        yield service


@contextmanager
def reward_service(cfg: RLHFConfig, session: RunSession, needed: bool = True) -> Iterator[Service | None]:
    if not needed:
        yield None
        return
    launch = cfg.reward.launch
    if launch == "in_process":
        from models.loop import build_local_reward

        backend = build_local_reward(cfg)
        try:
            yield Service("reward (in process)", backend)
        finally:
            backend.close()
        return
    from components.remote import remote_reward

    with remote_reward(cfg, session) as service:
        yield service
