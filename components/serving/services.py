"""The services of a run: its servers where they run, and the backends the algorithm scores with, for `rlhf train`
and the flows alike.

A run has up to three servers: the rollout server (rollout.engine=vllm: it holds its own copy of the actor's weights),
a critic server (an algorithm with a critic: values, and rewards when it carries the reward model) and a reward
server (unless the critic carries the reward model). Each starts where its section's `launch` says, one module per
mode, each giving a StartedServer (components/serving/started.py):
- `local`: child processes of this one (components/serving/local.py), one per replica, stopped when the block exits;
- `kubernetes`: a LeaderWorkerSet the run creates on its cluster (components/serving/kubernetes.py over
  components/cluster/servers.py), `replicas` pods found through its own DNS names, owned by the run's Job and deleted
  when the block exits;
- `in_process` (critic and reward only): no server.

Every server of a run takes requests of that run only (components/serving/auth.py): the run's secret (made here,
`run_secret`, once per run attempt, and kept in its RunPlace) reaches a local server through its environment and a
pod through a Kubernetes Secret of the run; every client of the run sends it. A server dies with its run: a local one
watches its parent process (processes.exit_with_parent: a SIGKILLed run leaves no server behind), a pod's
LeaderWorkerSet is owned by the run's Job.

`RunServices.guard` asks every server of the run why it cannot serve after a failed step (`death()`), so a run fails
naming the server that went away, not the broken connection. How the steps of starting them execute is the caller's
`Steps` (models/loop.py): directly (`rlhf train`), or as Prefect tasks whose messages go to the run's log (the flows:
components.tasks.FlowSteps). Everything is torn down on success, failure and cancellation (SIGTERM in a flow process
raises, so the `finally` blocks run).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from components.launch.processes import wait_for
from components.serving import kubernetes, local
from components.serving.auth import new_secret
from components.serving.launcher import trainer_host
from components.serving.rollout.client import RolloutClient, run_token
from components.serving.started import StartedServer, section
from components.serving.triton.clients import RewardClient, critic_backend, reward_backend
from components.tracking.run import RunPlace
from components.verifiers import rollouts as verifiers
from models.algorithms import ALGORITHMS
from models.backends import LocalCritic
from models.config import RLHFConfig
from models.engines import ENGINES
from models.loop import DIRECT, Steps, build_critic_trainer, build_local_reward, critic_text_reward

TEARDOWN_GRACE_S = 2.0
LAUNCHES = {"local": local.start, "kubernetes": kubernetes.start}  # launch -> start(kind, cfg, place, secret)


class ServerDied(RuntimeError):
    """A server of the run went away during the run; the message names it, its exit code and its log tail."""


@dataclass
class Service:
    """A ready backend plus what is needed to explain its failure."""

    name: str
    backend: object
    death: Callable[[], Optional[str]] = lambda: None  # why its server cannot serve, else None
    reward: object = None  # a critic carrying a reward model that reads text: its reward_text as a RewardBackend


@dataclass
class RunServices:
    """The servers of a training run and the scoring backends behind them."""

    services: list[Service]
    critic: object = None
    reward: object = None

    def guard(self, fn, *args, settle_s: float = 45.0, **kwargs):
        """Call a step; if it fails and one of the servers is gone, fail with a message naming it and its exit. A
        server that is going away may answer for a moment more (one that lost a rank fails its request first, then
        stops serving, then exits after Triton's exit timeout and its models' unloading: over 20 s on a loaded 2-core
        machine): its servers are looked at for up to `settle_s` (the failure is raised as soon as one is seen gone)
        before the step's own error stands."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            def gone() -> Optional[str]:
                return next((death for service in self.services if (death := service.death())), None)

            if death := wait_for(gone, settle_s if self.services else 0, poll_s=0.5):
                raise ServerDied(death) from exc
            raise


def run_secret(place: RunPlace) -> str:
    """The run's secret (components/serving/auth.py): made here, where the run's servers start, the first time one
    is asked for, and kept in the run's RunPlace for its other servers and clients."""
    if place.secret is None:
        place.secret = new_secret()
    return place.secret


# ------------------------------------------------------------------------------------------------ starting a server
@contextmanager
def started(kind: str, cfg: RLHFConfig, place: RunPlace, steps: Steps = DIRECT) -> Iterator[StartedServer]:
    """The `kind` server of the run, started where its section's `launch` says (LAUNCHES), not yet ready; stopped
    after the block, first thing (a cancelled run must not wait on an in-flight request)."""
    secret = run_secret(place)  # made here, before a step may see a copy of `place`
    server = steps(f"deploy-{kind}-server", LAUNCHES[section(kind, cfg).launch], kind, cfg, place, secret)
    steps.log(f"{kind} server starting: {server.describe()}")
    try:
        yield server
    finally:
        # the run is done with it (a critic's saves are complete and atomic): a local server gets TEARDOWN_GRACE_S to
        # stop by itself, then it is killed (PyTriton's graceful stop spends ~6 s polling its unloaded models)
        steps.log(f"{kind} server stopped: {server.stop(TEARDOWN_GRACE_S)}")


def wait_ready(kind: str, server: StartedServer, cfg: RLHFConfig, steps: Steps = DIRECT) -> str:
    """Wait until the started server (every replica) serves, saying every ~30 s in the run's log what it waits for;
    returns its URL (the first replica's)."""
    started_at = time.monotonic()
    health = steps("wait-until-ready", server.wait_until_ready, section(kind, cfg).ready_timeout_s, steps.log)
    steps.log(f"{kind} server ready at {', '.join(server.urls)} after {time.monotonic() - started_at:.1f}s"
              + (f": {health.info}" if health.info else ""))
    return server.url


# ------------------------------------------------------------------------------------------------ the services of a run
@contextmanager
def critic_service(cfg: RLHFConfig, place: RunPlace, steps: Steps = DIRECT) -> Iterator[Service]:
    if cfg.deploy.critic.launch == "in_process":
        backend = LocalCritic(build_critic_trainer(cfg, checkpoint_dir=place.critic_dir))
        reward = critic_text_reward(cfg, backend.trainer)
        try:
            yield Service("critic (in process)", backend, reward=reward)
        finally:
            backend.close()
            if reward is not None:
                reward.close()
        return
    with started("critic", cfg, place, steps) as server:
        url = wait_ready("critic", server, cfg, steps)
        backend = critic_backend(cfg, url, secret=run_secret(place))
        # a critic carrying a reward model that reads text serves rewards through reward_text, not critic_infer
        text = (RewardClient(url, timeout_s=cfg.deploy.critic.request_timeout_s, text=True, secret=run_secret(place))
                if cfg.critic_carries_reward and cfg.reward.transport == "text" else None)
        try:
            yield Service("critic server", backend, server.death, reward=text)
        finally:
            for client in (backend, text):
                if client is not None:
                    client.close()


@contextmanager
def reward_service(cfg: RLHFConfig, place: RunPlace, steps: Steps = DIRECT,
                   needed: bool = True) -> Iterator[Optional[Service]]:
    if not needed:
        yield None
        return
    if cfg.deploy.reward.launch == "in_process":
        backend = build_local_reward(cfg)
        try:
            yield Service("reward (in process)", backend)
        finally:
            backend.close()
        return
    with started("reward", cfg, place, steps) as server:
        backend = reward_backend(cfg, wait_ready("reward", server, cfg, steps), secret=run_secret(place))
        try:
            yield Service("reward server", backend, server.death)
        finally:
            backend.close()


@contextmanager
def rollout_server(cfg: RLHFConfig, place: RunPlace, steps: Steps = DIRECT):
    """For an engine with its own weights (rollout.engine=vllm), its rollout server started for the block (None for
    an engine that samples with the actor's own module). Start it before the actor: both load side by side."""
    if ENGINES[cfg.rollout.engine].shares_actor_weights:
        yield None
        return
    with started("rollout", cfg, place, steps) as server:
        yield server


def connect_engine(actor, urls: list[str], cfg: RLHFConfig, place: RunPlace) -> list[RolloutClient]:
    """Rank 0's engine talks to every replica (as this run, over the configured weight transfer: a group of its own
    per replica) and sends them the actor's current weights (a new run's, a resumed run's checkpoint, LoRA merged; all
    ranks gather them)."""
    token = run_token(place.run_name)  # one run token for all replicas: each serves this trainer only
    clients = []
    try:
        for url in urls:
            clients.append(RolloutClient(url, token, cfg.deploy.rollout.request_timeout_s, secret=run_secret(place)))
            if cfg.deploy.rollout.weight_transfer == "dist":
                clients[-1].use_dist(trainer_host(cfg))
        actor.state.engine.connect(clients)
        actor.refit()
    except BaseException:
        for client in clients:
            client.close()
        raise
    return clients


@contextmanager
def rollout_service(server, actor, cfg: RLHFConfig, place: RunPlace, steps: Steps = DIRECT) -> Iterator[list[Service]]:
    """[the rollout server's service] once `server` (from `rollout_server`) serves and rank 0's engine holds the
    actor's weights; [] without a rollout server."""
    if server is None:
        yield []
        return
    wait_ready("rollout", server, cfg, steps)
    clients = steps("connect-rollout-engine", connect_engine, actor, server.urls, cfg, place)
    steps.log(f"rollout engine at {', '.join(server.urls)} holds the actor's weights ({actor.state.engine.last_refit})")
    worker = None
    if v := cfg.environment.verifiers:  # verifiers' clients play the episodes against it, as this run, in one worker
        worker = verifiers.VerifiersWorker(run_secret(place), place.log_dir / f"verifiers-{v.id}.log",
                                           env_paths=v.paths)
        actor.state.episodes.source = verifiers.rollout_source(v, f"{server.urls[0]}/v1", worker)
    try:
        yield [Service("rollout server", clients, server.death)]
    finally:
        for client in clients:
            client.close()
        if worker is not None:
            worker.close()


@contextmanager
def run_services(cfg: RLHFConfig, place: RunPlace, actor, steps: Steps = DIRECT, rollout=None) -> Iterator[RunServices]:
    """The services of a training run: the rollout server (`rollout`, started before the actor) connected to
    `actor`, and what the algorithm scores with: a critic (values, and rewards when it carries the reward model) and a
    reward server unless the critic carries the reward model; without a critic, the reward server alone. An
    environment run scores its episodes in its environment workers: no reward server."""
    scored_apart = not cfg.environment.enabled
    with rollout_service(rollout, actor, cfg, place, steps) as rollouts:
        if not ALGORITHMS[cfg.algorithm].needs_critic:
            with reward_service(cfg, place, steps, needed=scored_apart) as reward:
                yield RunServices(rollouts + ([reward] if reward else []), reward=reward.backend if reward else None)
            return
        with critic_service(cfg, place, steps) as critic, \
                reward_service(cfg, place, steps, needed=scored_apart and not cfg.critic_carries_reward) as reward:
            yield RunServices(rollouts + [s for s in (critic, reward) if s is not None], critic=critic.backend,
                              reward=reward.backend if reward else critic.reward)
