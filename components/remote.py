"""Critic / reward servers for a flow: a local PyTriton child process, or a Prefect deployment on its own work pool.

launch=local: the task starts the server as a child process of the flow run (own process group) and stops it when
the block exits. launch=deployment: the task starts `critic-server/default` (or `reward-server/default`), which on a
GPU cluster runs on its own node; that flow run publishes its address in a Prefect variable named after itself, the
task waits until the server is ready, and cancels the flow run at the end.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from components.clients import critic_backend, reward_backend
from components.launcher import (CRITIC_MODELS, REWARD_MODELS, ServerProcess, find_free_ports, launch_critic,
                                 launch_reward, port_block_free, wait_until_ready)
from components.run import RunSession
from components.services import Service
from models.config import RLHFConfig

ADVERTISE_ENV = "RLHF_ADVERTISE_HOST"
CRITIC_STORE_KEY = "critic-server"  # the server's --checkpoint-key default


def _port(host: str, preferred: int) -> int:
    """The configured port if P..P+2 are free, else a free block (two runs on one machine must not collide)."""
    bind = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return preferred if port_block_free(bind, preferred) else find_free_ports(bind)


def _threads(section) -> int | None:
    """One torch thread for a server on a CPU-only host unless configured: it usually shares the cores with the actor."""
    import torch

    if section.torch_threads:
        return section.torch_threads
    return 1 if not torch.cuda.is_available() else None


def _death(name: str, proc: ServerProcess, settle_s: float = 5.0):
    def describe() -> str | None:
        # called after a request failed: a killed server may drop its connections a moment before its exit is seen
        deadline = time.monotonic() + settle_s
        while (code := proc.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if code is None:
            return None
        return f"{name} server (pid {proc.pid}, {proc.url}) exited with code {code}; last lines of {proc.log_path}:\n{proc.log_tail()}"
    return describe


@task(name="deploy-critic-server", cache_policy=NONE)
def start_local_server(kind: str, cfg: RLHFConfig, session: RunSession) -> ServerProcess:
    """Start the server as a child process (LD_LIBRARY_PATH for Triton's python stub is set by the launcher)."""
    section = cfg.critic if kind == "critic" else cfg.reward
    port = _port(section.host, section.http_port)
    log_path = session.local_dir / "logs" / f"{kind}-server.log"
    threads = _threads(section)
    if kind == "critic":
        proc = launch_critic(cfg, log_path, checkpoint_dir=session.critic_dir, port=port, wait=False, torch_threads=threads)
    else:
        proc = launch_reward(cfg, log_path, port=port, wait=False, torch_threads=threads)
    get_run_logger().info(f"{kind} server starting: pid {proc.pid}, {proc.url}, log {log_path}")
    return proc


@task(name="wait-until-ready", cache_policy=NONE)
def wait_ready(kind: str, url: str, timeout: float, proc: ServerProcess | None = None) -> None:
    started = time.monotonic()
    wait_until_ready(url, CRITIC_MODELS if kind == "critic" else REWARD_MODELS, timeout, process=proc)
    get_run_logger().info(f"{kind} server ready at {url} after {time.monotonic() - started:.1f}s")


@contextmanager
def _local(kind: str, cfg: RLHFConfig, session: RunSession) -> Iterator[Service]:
    proc = start_local_server.with_options(name=f"deploy-{kind}-server")(kind, cfg, session)
    client = None
    try:
        wait_ready(kind, proc.url, (cfg.critic if kind == "critic" else cfg.reward).ready_timeout_s, proc)
        client = critic_backend(cfg, proc.url) if kind == "critic" else reward_backend(cfg, proc.url)
        yield Service(f"{kind} server", client, _death(kind, proc))
    finally:
        code = proc.stop()  # first: a cancelled flow must not wait on an in-flight request before stopping the server
        if client is not None:
            client.close()
        get_run_logger().info(f"{kind} server stopped (pid {proc.pid}, exit code {code})")


# ------------------------------------------------------------------------------------------------ launch=deployment
def address_variable(flow_run_id) -> str:
    return f"rlhf_server_{str(flow_run_id).replace('-', '')}"


@task(name="deploy-server-deployment", cache_policy=NONE)
def start_deployment(kind: str, cfg: RLHFConfig, session: RunSession):
    from prefect.deployments import run_deployment

    parameters = {"config": cfg.model_dump(mode="json")}
    if kind == "critic":
        parameters["checkpoint_dir"] = str(session.critic_dir)
        parameters["checkpoint_uri"] = session.store.uri
    run = run_deployment(f"{kind}-server/default", parameters=parameters, timeout=0, as_subflow=False)
    get_run_logger().info(f"{kind} server: started deployment {kind}-server/default as flow run {run.id}")
    return run.id


@task(name="discover-server-address", cache_policy=NONE)
def discover_address(kind: str, flow_run_id, timeout: float) -> str:
    from prefect import get_client
    from prefect.variables import Variable

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        url = Variable.get(address_variable(flow_run_id), default=None)
        if url:
            return url
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
        if state is not None and state.is_final():
            raise RuntimeError(f"{kind} server flow run {flow_run_id} ended ({state.name}) before publishing its address")
        time.sleep(1.0)
    raise TimeoutError(f"{kind} server flow run {flow_run_id} did not publish its address within {timeout:.0f}s "
                       f"(is a worker serving {kind}-server/default?)")


def _flow_run_death(kind: str, flow_run_id):
    def describe() -> str | None:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
        if state is None or not state.is_final():
            return None
        return f"{kind} server flow run {flow_run_id} ended: {state.name} ({state.message or 'no message'})"
    return describe


def cancel_flow_run(flow_run_id) -> None:
    from prefect import get_client
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        if state is not None and not state.is_final():
            client.set_flow_run_state(flow_run_id, Cancelling(), force=True)


@contextmanager
def _deployment(kind: str, cfg: RLHFConfig, session: RunSession) -> Iterator[Service]:
    section = cfg.critic if kind == "critic" else cfg.reward
    flow_run_id = start_deployment.with_options(name=f"deploy-{kind}-server")(kind, cfg, session)
    client = None
    try:
        url = discover_address(kind, flow_run_id, section.ready_timeout_s)
        wait_ready(kind, url, section.ready_timeout_s)
        client = critic_backend(cfg, url) if kind == "critic" else reward_backend(cfg, url)
        yield Service(f"{kind} server", client, _flow_run_death(kind, flow_run_id))
    finally:
        cancel_flow_run(flow_run_id)
        if client is not None:
            client.close()
        get_run_logger().info(f"{kind} server: cancelled flow run {flow_run_id}")


@contextmanager
def remote_critic(cfg: RLHFConfig, session: RunSession) -> Iterator[Service]:
    with (_local if cfg.critic.launch == "local" else _deployment)("critic", cfg, session) as service:
        yield service


@contextmanager
def remote_reward(cfg: RLHFConfig, session: RunSession) -> Iterator[Service]:
    with (_local if cfg.reward.launch == "local" else _deployment)("reward", cfg, session) as service:
        yield service


# ------------------------------------------------------------------------------------------------ the server flow side
def host_server(kind: str, cfg: RLHFConfig, checkpoint_dir: str | None, checkpoint_uri: str | None = None) -> int:
    """Body of critic-server/default and reward-server/default: serve until cancelled, publish the address.

    With `checkpoint_uri` (the run's store), the critic restores `critic-server/` from the store when its local
    directory holds no checkpoint (a fresh node), and uploads every critic_save there.
    """
    from prefect.runtime import flow_run
    from prefect.variables import Variable

    from components.services import ServerDied

    logger = get_run_logger()
    section = cfg.critic if kind == "critic" else cfg.reward
    port = _port(section.host, section.http_port)
    log_dir = cfg.resolved_state_dir() / "servers"
    log_path = log_dir / f"{kind}-{flow_run.get_id()}.log"
    threads = _threads(section)
    if kind == "critic" and checkpoint_uri and checkpoint_dir:
        _restore_critic(checkpoint_uri, cfg.checkpoint.s3_endpoint_url, Path(checkpoint_dir))
    proc = (launch_critic(cfg, log_path, checkpoint_dir=checkpoint_dir, port=port, wait=False, torch_threads=threads,
                          checkpoint_uri=checkpoint_uri) if kind == "critic"
            else launch_reward(cfg, log_path, port=port, wait=False, torch_threads=threads))
    name = address_variable(flow_run.get_id())
    try:
        proc.wait_until_ready(section.ready_timeout_s)
        host = os.environ.get(ADVERTISE_ENV) or (
            socket.gethostbyname(socket.gethostname()) if section.host in ("0.0.0.0", "::") else section.host)
        url = f"http://{host}:{port}"
        Variable.set(name, url, overwrite=True)
        logger.info(f"{kind} server ready at {url} (pid {proc.pid}); serving until this flow run is cancelled")
        while proc.poll() is None:
            time.sleep(1.0)
        raise ServerDied(_death(kind, proc)())
    finally:
        proc.stop()
        try:
            Variable.unset(name)
        except Exception:  # noqa: BLE001 - best effort: the API may be going away with us
            pass
        logger.info(f"{kind} server stopped")


def _restore_critic(store_uri: str, endpoint: str | None, directory: Path) -> None:
    from components.checkpoints import CheckpointStore

    if (directory / "critic_state.pt").exists():
        return
    store = CheckpointStore.from_uri(store_uri, s3_endpoint_url=endpoint)
    try:
        store.get_dir(CRITIC_STORE_KEY, directory)
        get_run_logger().info(f"critic restored from {store_uri}/{CRITIC_STORE_KEY}")
    except Exception as exc:  # noqa: BLE001 - nothing stored yet: a new run
        get_run_logger().info(f"no critic checkpoint in {store_uri}/{CRITIC_STORE_KEY} ({exc}); starting fresh")
