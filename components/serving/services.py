"""Where the critic / reward run for a flow: in this process, a local PyTriton child process, or a Prefect deployment.

`critic_service(cfg, session)` and `reward_service(cfg, session)` are context managers: they deploy the server, wait
until it is ready, yield a `Service` (its backend implements models/backends.py), and tear the server down on success,
failure and cancellation (SIGTERM in the flow process raises, so the `finally` runs).

launch=local: a child process of the flow run (own process group), stopped when the block exits; its critic saves
into the run's local directory. launch=deployment: the task starts `critic-server/default` (or
`reward-server/default`), which on a GPU cluster runs on its own node; that flow run publishes its address in a
Prefect variable named after itself, the task waits until the server is ready, and cancels the flow run at the end.
Its critic uploads each save to the run's checkpoint store, where the next checkpoint adopts it into iter_<N>/critic,
and a resumed run tells it which iteration's critic to start from.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, NoReturn, Optional

import torch
from prefect import get_client, get_run_logger, task
from prefect.cache_policies import NONE
from prefect.deployments import run_deployment
from prefect.runtime import flow_run
from prefect.states import Cancelling
from prefect.variables import Variable

from components.launch.processes import find_free_ports, port_block_free, wait_for
from components.serving.clients import RewardClient, critic_backend, reward_backend
from components.serving.launcher import ServerProcess, launch, wait_until_ready
from components.serving.rollout import RolloutServer, connect, wait_health
from components.serving.servers import ServerSpec
from components.tracking.run import RunSession
from models.algorithms import ALGORITHMS
from models.backends import LocalCritic
from models.config import RLHFConfig
from models.loop import build_critic_trainer, build_local_reward, critic_text_reward

ADVERTISE_ENV = "RLHF_ADVERTISE_HOST"


class ServerDied(RuntimeError):
    """A critic/reward server went away during the run; the message names it, its exit code and its log tail."""


@dataclass
class Service:
    """A ready backend plus what is needed to explain its failure."""

    name: str
    backend: object
    describe_death: Callable[[], Optional[str]] = lambda: None  # message if the server is gone, else None
    reward: object = None  # a critic carrying a reward model that reads text: its reward_text as a RewardBackend


@dataclass
class Scoring:
    """The scoring backends of a training run (critic and/or reward) and the servers behind them."""

    services: list
    critic: object = None
    reward: object = None

    def guard(self, fn, *args, **kwargs):
        """Call a step; if it fails and one of the servers is gone, fail with a message naming it and its exit."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            for service in self.services:
                if death := service.describe_death():
                    raise ServerDied(death) from exc
            raise


@contextmanager
def scoring_services(cfg: RLHFConfig, session: RunSession, actor=None) -> Iterator[Scoring]:
    """The servers of a run: a rollout server when the actor's engine holds its own weights (connected to `actor`,
    given its weights), and what the algorithm scores with: a critic (values, and rewards when it carries the reward
    model) and a reward server unless the critic carries the reward model; without a critic, the reward server alone."""
    with rollout_service(cfg, session, actor) as rollout:
        if not ALGORITHMS[cfg.algorithm].needs_critic:
            with reward_service(cfg, session) as reward:
                yield Scoring(rollout + [reward], reward=reward.backend)
            return
        with critic_service(cfg, session) as critic, \
                reward_service(cfg, session, needed=not cfg.critic.combine_reward) as reward:
            yield Scoring(rollout + [s for s in (critic, reward) if s is not None], critic=critic.backend,
                          reward=reward.backend if reward else critic.reward)


@contextmanager
def rollout_service(cfg: RLHFConfig, session: RunSession, actor=None) -> Iterator[list[Service]]:
    """[the rollout server] for an engine with its own weights (rollout.engine=vllm), else []: started (launch=local)
    or deployed (launch=deployment), ready, connected to rank 0's engine and given the actor's weights."""
    if actor is None or actor.state.engine.shares_actor_weights:
        yield []
        return
    local = cfg.rollout.vllm.launch == "local"
    with (_local_rollout if local else _deployment_rollout)(cfg, session, actor) as service:
        yield [service]


@contextmanager
def critic_service(cfg: RLHFConfig, session: RunSession) -> Iterator[Service]:
    if cfg.critic.launch == "in_process":
        backend = LocalCritic(build_critic_trainer(cfg, checkpoint_dir=session.critic_dir))
        reward = critic_text_reward(cfg, backend.trainer)
        try:
            yield Service("critic (in process)", backend, reward=reward)
        finally:
            backend.close()
            if reward is not None:
                reward.close()
        return
    with (_local if cfg.critic.launch == "local" else _deployment)("critic", cfg, session) as service:
        yield service


@contextmanager
def reward_service(cfg: RLHFConfig, session: RunSession, needed: bool = True) -> Iterator[Optional[Service]]:
    if not needed:
        yield None
        return
    if cfg.reward.launch == "in_process":
        backend = build_local_reward(cfg)
        try:
            yield Service("reward (in process)", backend)
        finally:
            backend.close()
        return
    with (_local if cfg.reward.launch == "local" else _deployment)("reward", cfg, session) as service:
        yield service


def _section(kind: str, cfg: RLHFConfig):
    return cfg.critic if kind == "critic" else cfg.reward


def _port(host: str, preferred: int) -> int:
    """The configured port if P..P+2 are free, else a free block (two runs on one machine must not collide)."""
    bind = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return preferred if port_block_free(bind, preferred) else find_free_ports(bind)


def _threads(section) -> Optional[int]:
    """One torch thread for a server on a CPU-only host unless configured: it usually shares the cores with the actor."""
    if section.torch_threads:
        return section.torch_threads
    return 1 if not torch.cuda.is_available() else None


def server_spec(kind: str, cfg: RLHFConfig, **fields) -> ServerSpec:
    """The spec of this run's critic/reward server: its section's host, a free port block, its thread count."""
    section = _section(kind, cfg)
    return ServerSpec(kind=kind, config=cfg, host=section.host, port=_port(section.host, section.http_port),
                      torch_threads=_threads(section), **fields)


def _text_rewards(kind: str, cfg: RLHFConfig, url: str):
    """A critic server whose reward model reads text serves rewards through reward_text, not critic_infer."""
    if kind != "critic" or not cfg.critic.combine_reward or cfg.reward.transport != "text":
        return None
    return RewardClient(url, timeout_s=cfg.critic.request_timeout_s, text=True)


def _death(name: str, proc: ServerProcess, settle_s: float = 20.0):
    def describe() -> Optional[str]:
        # called after a request failed: a killed server may drop its connections a moment before its exit is seen,
        # and a server that lost one of its ranks stops Triton (seconds) before it exits
        wait_for(lambda: proc.poll() is not None, settle_s)
        if (code := proc.poll()) is None:
            return None
        tail = proc.log_tail()
        # the reason is searched further back than the tail shown: Triton's shutdown countdown after it can take
        # more than the tail's 30 lines on a loaded machine
        errors = [line.split(" ERROR ", 1)[1] for line in proc.log_tail(400).splitlines() if " ERROR " in line]
        why = f": {errors[-1]}" if errors else ""  # e.g. "rlhf.server: critic server: critic rank 1 (pid) exited ..."
        return (f"{name} server (pid {proc.pid}, {proc.url}) exited with code {code}{why}; last lines of "
                f"{proc.log_path}:\n{tail}")
    return describe


# ------------------------------------------------------------------------------------------------ launch=local
@task(name="deploy-critic-server", cache_policy=NONE)
def start_local_server(kind: str, cfg: RLHFConfig, session: RunSession) -> ServerProcess:
    """Start the server as a child process of this flow run."""
    log_path = session.local_dir / "logs" / f"{kind}-server.log"
    spec = server_spec(kind, cfg, checkpoint_dir=str(session.critic_dir) if kind == "critic" else None)
    proc = launch(spec, log_path, wait=False)
    get_run_logger().info(f"{kind} server starting: pid {proc.pid}, {proc.url}, log {log_path}")
    return proc


@task(name="wait-until-ready", cache_policy=NONE)
def wait_ready(kind: str, url: str, timeout: float, proc: Optional[ServerProcess] = None,
               cfg: Optional[RLHFConfig] = None) -> None:
    started = time.monotonic()
    wait_until_ready(url, ServerSpec(kind=kind, config=cfg or RLHFConfig()).models, timeout, process=proc)
    get_run_logger().info(f"{kind} server ready at {url} after {time.monotonic() - started:.1f}s")


@contextmanager
def _local(kind: str, cfg: RLHFConfig, session: RunSession) -> Iterator[Service]:
    proc = start_local_server.with_options(name=f"deploy-{kind}-server")(kind, cfg, session)
    clients = []
    try:
        wait_ready(kind, proc.url, _section(kind, cfg).ready_timeout_s, proc, cfg=cfg)
        clients = [critic_backend(cfg, proc.url) if kind == "critic" else reward_backend(cfg, proc.url),
                   _text_rewards(kind, cfg, proc.url)]
        yield Service(f"{kind} server", clients[0], _death(kind, proc), reward=clients[1])
    finally:
        code = proc.stop()  # first: a cancelled flow must not wait on an in-flight request before stopping the server
        for client in clients:
            if client is not None:
                client.close()
        get_run_logger().info(f"{kind} server stopped (pid {proc.pid}, exit code {code})")


@task(name="deploy-rollout-server", cache_policy=NONE)
def start_local_rollout_server(cfg: RLHFConfig, session: RunSession) -> RolloutServer:
    server = RolloutServer(cfg, session.local_dir / "logs" / "rollout-server.log")
    get_run_logger().info(f"rollout server starting: pid {server.pid}, {server.url}, log {server.log_path}")
    return server


@task(name="connect-rollout-engine", cache_policy=NONE)
def connect_rollout_engine(actor, url: str, cfg: RLHFConfig):
    """Rank 0's engine talks to the server; the actor's current weights (new, resumed, LoRA merged) go to it."""
    client = connect(actor, url, cfg)
    get_run_logger().info(f"rollout engine at {url} holds the actor's weights ({actor.state.engine.last_refit})")
    return client


@contextmanager
def _local_rollout(cfg: RLHFConfig, session: RunSession, actor) -> Iterator[Service]:
    server = start_local_rollout_server(cfg, session)
    client = None
    try:
        wait_rollout_ready(server.url, cfg.rollout.vllm.ready_timeout_s, server)
        client = connect_rollout_engine(actor, server.url, cfg)
        yield Service("rollout server", client, server.death)
    finally:
        code = server.stop()
        if client is not None:
            client.close()
        get_run_logger().info(f"rollout server stopped (pid {server.pid}, exit code {code})")


@task(name="wait-until-ready", cache_policy=NONE)
def wait_rollout_ready(url: str, timeout: float, server: Optional[RolloutServer] = None) -> None:
    started = time.monotonic()
    info = (server.wait_until_ready(timeout) if server is not None else wait_health(url, timeout))
    get_run_logger().info(f"rollout server ready at {url} after {time.monotonic() - started:.1f}s: {info}")


@contextmanager
def _deployment_rollout(cfg: RLHFConfig, session: RunSession, actor) -> Iterator[Service]:
    flow_run_id = start_deployment.with_options(name="deploy-rollout-server")("rollout", cfg, session)
    client = None
    try:
        url = discover_address("rollout", flow_run_id, cfg.rollout.vllm.ready_timeout_s)
        wait_rollout_ready(url, cfg.rollout.vllm.ready_timeout_s)
        client = connect_rollout_engine(actor, url, cfg)
        yield Service("rollout server", client, _flow_run_death("rollout", flow_run_id))
    finally:
        cancel_flow_run(flow_run_id)
        if client is not None:
            client.close()
        get_run_logger().info(f"rollout server: cancelled flow run {flow_run_id}")


# ------------------------------------------------------------------------------------------------ launch=deployment
def address_variable(flow_run_id) -> str:
    return f"rlhf_server_{str(flow_run_id).replace('-', '')}"


@task(name="deploy-server-deployment", cache_policy=NONE)
def start_deployment(kind: str, cfg: RLHFConfig, session: RunSession):
    parameters = {"config": cfg.model_dump(mode="json")}
    if kind == "critic":
        parameters.update(checkpoint_uri=session.store.uri, restore_iteration=session.critic_restore_iteration)
    run = run_deployment(f"{kind}-server/default", parameters=parameters, timeout=0, as_subflow=False)
    get_run_logger().info(f"{kind} server: started deployment {kind}-server/default as flow run {run.id}")
    return run.id


def _final_state(flow_run_id):
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
    return state if state is not None and state.is_final() else None


@task(name="discover-server-address", cache_policy=NONE)
def discover_address(kind: str, flow_run_id, timeout: float) -> str:
    def published() -> Optional[str]:
        url = Variable.get(address_variable(flow_run_id), default=None)
        if not url and (state := _final_state(flow_run_id)) is not None:
            raise RuntimeError(f"{kind} server flow run {flow_run_id} ended ({state.name}) before publishing its "
                               f"address: {state.message or 'no message'}")
        return url

    url = wait_for(published, timeout, poll_s=1.0)
    if url:
        return url
    raise TimeoutError(f"{kind} server flow run {flow_run_id} did not publish its address within {timeout:.0f}s "
                       f"(is a worker serving {kind}-server/default?)")


def _flow_run_death(kind: str, flow_run_id):
    def describe() -> Optional[str]:
        state = _final_state(flow_run_id)
        return None if state is None else f"{kind} server flow run {flow_run_id} ended: {state.name} ({state.message or 'no message'})"
    return describe


def cancel_flow_run(flow_run_id) -> None:
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        if state is not None and not state.is_final():
            client.set_flow_run_state(flow_run_id, Cancelling(), force=True)


@contextmanager
def _deployment(kind: str, cfg: RLHFConfig, session: RunSession) -> Iterator[Service]:
    section = _section(kind, cfg)
    flow_run_id = start_deployment.with_options(name=f"deploy-{kind}-server")(kind, cfg, session)
    clients = []
    try:
        url = discover_address(kind, flow_run_id, section.ready_timeout_s)
        wait_ready(kind, url, section.ready_timeout_s, cfg=cfg)
        clients = [critic_backend(cfg, url) if kind == "critic" else reward_backend(cfg, url),
                   _text_rewards(kind, cfg, url)]
        yield Service(f"{kind} server", clients[0], _flow_run_death(kind, flow_run_id), reward=clients[1])
    finally:
        cancel_flow_run(flow_run_id)
        for client in clients:
            if client is not None:
                client.close()
        get_run_logger().info(f"{kind} server: cancelled flow run {flow_run_id}")


# ------------------------------------------------------------------------------------------------ the server flow side
def host_rollout_server(cfg: RLHFConfig) -> int:
    """Body of rollout-server/default: start the vLLM rollout server, publish its address, serve until cancelled."""
    run_id = flow_run.get_id()
    server = RolloutServer(cfg, cfg.resolved_state_dir() / "servers" / f"rollout-{run_id}" / "rollout-server.log")
    try:
        server.wait_until_ready(cfg.rollout.vllm.ready_timeout_s)
        serve_published("rollout", server, f"http://{advertised_host(cfg.rollout.vllm.host)}:{server.port}",
                        server.death)
    finally:
        server.stop()
        get_run_logger().info("rollout server stopped")


def serve_published(kind: str, process, url: str, describe_death: Callable[[], Optional[str]]) -> NoReturn:
    """Publish a ready server's `url` for the flow run that deployed this one (a Prefect variable named after this
    flow run), then wait until the server exits (a failure) or this flow run is cancelled; unpublish either way."""
    name = address_variable(flow_run.get_id())
    try:
        Variable.set(name, url, overwrite=True)
        get_run_logger().info(f"{kind} server ready at {url} (pid {process.pid}); serving until this flow run is "
                              f"cancelled")
        wait_for(lambda: process.poll() is not None, None, poll_s=1.0)  # until the server exits, or we are cancelled
        raise ServerDied(describe_death())
    finally:
        try:
            Variable.unset(name)
        except Exception:  # noqa: BLE001 - best effort: the API may be going away with us
            pass


def advertised_host(bind: str) -> str:
    """The address other pods reach a server bound to `bind` at."""
    return os.environ.get(ADVERTISE_ENV) or (socket.gethostbyname(socket.gethostname()) if bind in ("0.0.0.0", "::") else bind)


def host_server(kind: str, cfg: RLHFConfig, checkpoint_uri: Optional[str] = None,
                restore_iteration: Optional[int] = None) -> int:
    """Body of critic-server/default and reward-server/default: serve until cancelled, publish the address.

    The critic saves into a fresh directory of this flow run and uploads every save to the run's store at
    `checkpoint_uri`; with `restore_iteration` it starts from iter_<N>/critic of that store (any error doing so
    fails this flow run, and with it the training flow run, naming the URI and the cause).
    """
    logger = get_run_logger()
    run_id = flow_run.get_id()
    server_dir = cfg.resolved_state_dir() / "servers" / f"{kind}-{run_id}"
    fields = {}
    if kind == "critic":
        fields = {"checkpoint_dir": str(server_dir / "critic"), "checkpoint_uri": checkpoint_uri,
                  "restore_iteration": restore_iteration}
    spec = server_spec(kind, cfg, **fields)
    proc = launch(spec, server_dir / f"{kind}-server.log", wait=False)
    try:
        proc.wait_until_ready(spec.section.ready_timeout_s)
        serve_published(kind, proc, f"http://{advertised_host(spec.host)}:{spec.port}", _death(kind, proc))
    finally:
        proc.stop()
        shutil.rmtree(server_dir / "critic", ignore_errors=True)  # every save is in the store
        logger.info(f"{kind} server stopped")
