"""The servers of a run and where they run: one way to start each, for `rlhf train` and the flows alike.

A run has up to three servers: the rollout server (rollout.engine=vllm: it holds its own copy of the actor's weights),
a critic server (an algorithm with a critic: values, and rewards when it carries the reward model) and a reward
server (unless the critic carries the reward model). Each runs where its section's `launch` says:
- `local`: a `ServerProcess` of this process (components/launch/processes.py; launcher.py says how each kind starts
  and is probed), in its own process group, stopped when the block exits;
- `deployment`: its Prefect deployment (`critic-server/default`, `reward-server/default`, `rollout-server/default`),
  on a cluster its own node; that flow run publishes its address in a Prefect variable named after itself, we wait
  until the server there is ready, and cancel the flow run at the end. A deployment critic uploads each save to the
  run's checkpoint store, where the next checkpoint adopts it into iter_<N>/critic, and a resumed run tells it which
  iteration's critic to start from;
- `kubernetes`: a LeaderWorkerSet the run creates on its cluster (components/cluster/servers.py), `replicas` pods
  found through its own DNS names, owned by the run's Job and deleted when the block exits;
- `in_process` (critic and reward only): no server.

Every server of a run takes requests of that run only (components/serving/auth.py): the run's secret (made here,
`run_secret`, once per run attempt, and kept in its RunPlace) reaches a local server through its environment, and a
deployment's through a Prefect Secret block named per run (its name is the flow run's parameter, never the value;
deleted when the server stops); every client of the run sends it. A server dies with its run: a local one watches its parent process
(processes.exit_with_parent: a SIGKILLed run leaves no server behind), a deployment's flow run watches a lease the run
holds in its own store for that server (`servers/<kind>-<id>`, components/storage/lease.py: a file lock the kernel
drops with the run's process, or an S3 object the run renews; the server's `lease` parameter names it) and stops its
server as soon as the lease is gone (S3: not renewed for `LEASE_TIMEOUT_S`): the run ended, was cancelled or crashed;
or as soon as the training flow run's state is final. The run's store must be one its servers reach (S3 on a
cluster, as the critic's saves need it anyway): a server that cannot see its run's lease fails at once, saying so. On
Kubernetes a deployment server's pod is labelled as the run's, and NetworkPolicies let only the run's own actor pods
reach it (components/cluster/network_policy.py).

Both kinds of started server answer the same three questions: `wait_until_ready` (saying every ~30 s in the run's log
what it waits for and how long it has waited), `death()` (why it cannot serve: it exited, its flow run ended, or it
answers but is unhealthy) and `stop()`. `RunServices.guard` asks every server of the run after a failed step, so a
run fails naming the server that went away, not the broken connection. The rollout server is `deploy.rollout.replicas`
servers (`Replicas`: one per replica, each on its own port or its own flow run) answering the same questions, with
their `urls`: ready when every replica is, dead when one is (named: 'rollout server replica 1 (pid, url) exited ...').

How the steps of starting them execute is the caller's `Steps` (models/loop.py): directly (`rlhf train`), or as
Prefect tasks whose messages go to the run's log (the flows: components.tasks.FlowSteps). Everything is torn down on success, failure
and cancellation (SIGTERM in a flow process raises, so the `finally` blocks run).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from components.cluster.network_policy import RUN_POLICIES, own_job
from components.cluster.servers import start_servers
from components.launch.processes import (REPORT_EVERY_S, Health, Probe, ServerProcess, free_port, wait_for,
                                         wait_until_ready)
from components.serving.auth import new_secret
from components.serving.launcher import launch, launch_rollout, rollout_probe, triton_probe
from components.serving.rollout.client import RolloutClient, run_token
from components.serving.triton.clients import RewardClient, critic_backend, reward_backend
from components.serving.triton.contract import ServerSpec
from components.storage.lease import Lease, acquire as acquire_lease, holder_alive
from components.storage.store import CheckpointStore
from components.tracking.run import RunPlace
from components.verifiers import rollouts as verifiers
from models.algorithms import ALGORITHMS
from models.backends import LocalCritic
from models.config import RLHFConfig
from models.engines import ENGINES
from models.loop import DIRECT, Steps, build_critic_trainer, build_local_reward, critic_text_reward

ADVERTISE_ENV = "RLHF_ADVERTISE_HOST"
TEARDOWN_GRACE_S = 2.0
LEASE_TIMEOUT_S = 30.0  # a deployment server whose run's lease (S3) was not renewed for this long stops (its run is gone)
SERVER_LEASES = "servers"  # in a run's store: the leases its deployment servers watch


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


def section(kind: str, cfg: RLHFConfig):
    """The deployment section of a server kind: its launch mode, host, port, timeouts."""
    return {"critic": cfg.deploy.critic, "reward": cfg.deploy.reward, "rollout": cfg.deploy.rollout}[kind]


def _threads(section) -> Optional[int]:
    """One torch thread for a server on a CPU-only host unless configured: it usually shares the cores with the actor."""
    if section.torch_threads:
        return section.torch_threads
    return 1 if not torch.cuda.is_available() else None


def server_spec(kind: str, cfg: RLHFConfig, **fields) -> ServerSpec:
    """The spec of a critic/reward server: its section's host, a free port, its thread count."""
    s = section(kind, cfg)
    return ServerSpec(kind=kind, config=cfg, host=s.host, port=free_port(s.host, s.port),
                      torch_threads=_threads(s), **fields)


def local_server(kind: str, cfg: RLHFConfig, log_path: Path, secret: str, trainer_host: Optional[str] = None,
                 **spec_fields) -> ServerProcess:
    """The `kind` server as a child process of this one (not waited for), holding the run's `secret`; a rollout
    server sets up weight transfers with `trainer_host` only (None: this machine)."""
    if kind == "rollout":
        return launch_rollout(cfg, log_path, secret=secret, trainer_host=trainer_host or "127.0.0.1")
    return launch(server_spec(kind, cfg, **spec_fields), log_path, wait=False, secret=secret)


def probe_at(kind: str, cfg: RLHFConfig, secret: Optional[str] = None) -> Callable[[str], Probe]:
    """How to look at a `kind` server found at a URL (one we did not start; with the run's `secret`, the server must
    prove it holds it, and a model that is not ready is looked up in its repository summary, which names why)."""
    if kind == "rollout":
        return lambda url: rollout_probe(url, secret=secret)
    models = ServerSpec(kind=kind, config=cfg).models
    return lambda url: triton_probe(url, models, secret)


# ------------------------------------------------------------------------------------------------ deployments
def address_variable(flow_run_id) -> str:
    return f"rlhf_server_{str(flow_run_id).replace('-', '')}"


def current_state(flow_run_id):
    from prefect import get_client  # heavy (~2 s): only a run with deployment servers talks to Prefect

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def final_state(flow_run_id):
    state = current_state(flow_run_id)
    return state if state is not None and state.is_final() else None


def cancel_flow_run(flow_run_id) -> None:
    from prefect import get_client  # heavy: as above
    from prefect.states import Cancelling  # heavy: as above

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        if state is not None and not state.is_final():
            client.set_flow_run_state(flow_run_id, Cancelling(), force=True)


def secret_block_name(run_name: str) -> str:
    """A Prefect Secret block's name for one server of run `run_name` (block names: lowercase, digits, dashes)."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")[:40] or "run"
    return f"rlhf-secret-{slug}-{secrets.token_hex(4)}"


def save_secret(name: str, secret: str) -> None:
    from prefect.blocks.system import Secret  # heavy: only a run with deployment servers stores one

    Secret(value=secret).save(name, overwrite=True)


def load_secret(name: str) -> str:
    from prefect.blocks.system import Secret  # heavy: as above

    return Secret.load(name).get()


def delete_secret(name: str) -> None:
    from prefect.blocks.system import Secret  # heavy: as above

    try:
        Secret.delete(name)
    except Exception:  # noqa: BLE001 - already gone (or the API is going away with us): nothing left to protect
        pass


def server_lease(kind: str, cfg: RLHFConfig, place: RunPlace) -> tuple[Lease, str]:
    """The run's side of a deployment server's lease: `servers/<kind>-<id>` in the run's store, held by this process
    until the server is stopped; returns it and its URI (the server's `lease` parameter)."""
    store = CheckpointStore.from_uri(place.store_uri, s3_endpoint_url=cfg.deploy.checkpoint.s3_endpoint_url)
    key = f"{SERVER_LEASES}/{kind}-{secrets.token_hex(6)}"
    lease = acquire_lease(store, f"the {kind} server of run {place.run_name}", key, timeout_s=LEASE_TIMEOUT_S)
    return lease, f"{store.uri.rstrip('/')}/{key}"


def lease_lost(lease_uri: Optional[str], training_flow_run_id=None, timeout_s: float = LEASE_TIMEOUT_S,
               s3_endpoint_url: Optional[str] = None):
    """The server flow run's side of its run's lease (`server_lease`): a callable that returns why the server must
    stop (the lease is gone: released, its holder's process ended, or on S3 not renewed for `timeout_s` by the
    store's own clock, so no clock skew between pods matters; or the training flow run's state is final), else
    None. A lease it cannot see when it starts fails at once (the run's store is not one this server reaches)."""
    watched = None
    if lease_uri:
        store_uri, _, name = lease_uri.rpartition(f"/{SERVER_LEASES}/")
        store = CheckpointStore.from_uri(store_uri, s3_endpoint_url=s3_endpoint_url)
        watched = (store, f"{SERVER_LEASES}/{name}")
        if holder_alive(*watched, timeout_s) is None:
            raise RuntimeError(f"this server's run holds no lease at {lease_uri} as this server sees it: the run is "
                               f"gone, or its checkpoint store (deploy.checkpoint.uri) is not one this server reaches "
                               f"(a cluster's servers need a shared store: S3)")

    def lost():
        if training_flow_run_id is not None and (state := final_state(training_flow_run_id)) is not None:
            return f"its training flow run {training_flow_run_id} ended ({state.name})"
        if watched is not None and holder_alive(*watched, timeout_s) is None:
            return (f"its run's lease ({lease_uri}) is gone (released, its process ended, or not renewed for "
                    f"{timeout_s:.0f}s): the training run ended, was cancelled or crashed")
        return None
    return lost


class DeploymentServer:
    """A server run by its Prefect deployment (its own flow run, on a cluster its own node): found at the address its
    flow run publishes, probed like a local one, stopped by cancelling that flow run. The run holds the server's
    lease while it lives (released when it stops), and its Secret block is deleted when it stops."""

    def __init__(self, kind: str, flow_run_id, probe_for: Callable[[str], Probe], lease: Lease,
                 secret_block: Optional[str] = None, policies=None, title: Optional[str] = None):
        self.name, self.flow_run_id, self.probe_for = kind, flow_run_id, probe_for
        self.title = title or f"{kind} server"
        self.secret_block, self.policies = secret_block, policies
        self.url: Optional[str] = None
        self.probe: Optional[Probe] = None
        self.lease = lease

    def wait_until_ready(self, timeout: float, report: Optional[Callable[[str], None]] = None) -> Health:
        """Wait for the published address, then for the server there to serve (one timeout for both: a cold GPU
        pool's pod start and image pull count); `report` is told every ~30 s what is awaited."""
        from prefect.variables import Variable  # heavy: as current_state's prefect

        started = time.monotonic()
        deadline, said = started + timeout, [started]

        def published() -> Optional[str]:
            url = Variable.get(address_variable(self.flow_run_id), default=None)
            if url:
                return url
            state = current_state(self.flow_run_id)
            if state is not None and state.is_final():
                raise ServerDied(f"{self.title} flow run {self.flow_run_id} ended ({state.name}) before "
                                 f"publishing its address: {state.message or 'no message'}")
            if report is not None and (now := time.monotonic()) - said[0] >= REPORT_EVERY_S:
                said[0] = now
                report(f"waiting for the {self.title}'s flow run {self.flow_run_id} to start and publish its address: "
                       f"{state.name if state is not None else 'no state yet'} ({now - started:.0f} s of "
                       f"{timeout:.0f} s)")
            return None

        self.url = wait_for(published, timeout, poll_s=1.0)
        if not self.url:
            raise TimeoutError(f"{self.title} flow run {self.flow_run_id} did not publish its address within "
                               f"{timeout:.0f}s (is a worker serving {self.name}-server/default?)")
        self.probe = self.probe_for(self.url)
        return wait_until_ready(self.probe, max(1.0, deadline - time.monotonic()), self.title, self.url,
                                report=report)

    def death(self, settle_s: float = 20.0) -> Optional[str]:
        """Its flow run ended (with its state's message), or the server answers but is unhealthy; else None."""
        if (state := final_state(self.flow_run_id)) is None:
            health = self.probe() if self.probe is not None else Health(True, "not probed")
            if health.ok:
                return None
            state = wait_for(lambda: final_state(self.flow_run_id), settle_s, poll_s=1.0)
            if state is None:
                return f"{self.title} ({self.url}, flow run {self.flow_run_id}) is not healthy: {health.status}"
        return f"{self.title} flow run {self.flow_run_id} ended: {state.name} ({state.message or 'no message'})"

    def stop(self) -> None:
        try:
            cancel_flow_run(self.flow_run_id)
        finally:
            self.lease.release()
            if self.secret_block:
                delete_secret(self.secret_block)
            if self.policies is not None:
                self.policies.release()


def start_deployment(kind: str, cfg: RLHFConfig, place: RunPlace, title: Optional[str] = None) -> DeploymentServer:
    """Run `kind`'s deployment for this run: the run's secret in a Secret block of its own (the flow run's parameter
    is the block's name), this flow run's id for the server to watch, and (a rollout server) the address the run's
    weight transfers come from."""
    from prefect.deployments import run_deployment  # heavy: as current_state's prefect
    from prefect.runtime import flow_run  # heavy: as above

    block = secret_block_name(place.run_name)
    save_secret(block, run_secret(place))
    job = own_job()  # on Kubernetes: the server's pod is labelled as this run's, and takes traffic from it only
    lease, lease_uri = server_lease(kind, cfg, place)
    try:
        parameters = {"config": cfg.model_dump(mode="json"), "secret_block": block, "lease": lease_uri,
                      "training_flow_run_id": str(flow_run.get_id()) if flow_run.get_id() else None}
        if kind == "critic":
            parameters.update(checkpoint_uri=place.store_uri, restore_iteration=place.critic_restore_iteration)
        if kind == "rollout":
            parameters.update(trainer_host=trainer_host(cfg))
        if job:
            RUN_POLICIES.acquire(job)
        try:
            run = run_deployment(f"{kind}-server/default", parameters=parameters, timeout=0, as_subflow=False,
                                 job_variables={"run_label": job} if job else None)
        except BaseException:
            if job:
                RUN_POLICIES.release()
            raise
    except BaseException:
        delete_secret(block)
        lease.release()
        raise
    return DeploymentServer(kind, run.id, probe_at(kind, cfg, run_secret(place)), lease, block,
                            policies=RUN_POLICIES if job else None, title=title)


class Replicas:
    """The rollout server's replicas as one server of the run: one server each (a `ServerProcess` of this process, or
    a `DeploymentServer`), on a port or a flow run of its own. Ready when every replica serves; dead when one is,
    named; stopped together. The interface every launch of the rollout server answers (a LeaderWorkerSet's too:
    components/cluster/servers.py): `urls`, `wait_until_ready`, `death`, `stop`."""

    name = "rollout"

    def __init__(self, servers: list):
        self.servers = servers

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    @property
    def url(self) -> str:
        return self.servers[0].url

    def wait_until_ready(self, timeout: float, report: Optional[Callable[[str], None]] = None) -> Health:
        """Wait for each replica in turn, within one `timeout` for all (they start together); what each answered."""
        deadline = time.monotonic() + timeout
        seen = [server.wait_until_ready(max(1.0, deadline - time.monotonic()), report) for server in self.servers]
        return Health(True, "ready", info={server.title: health.info for server, health in zip(self.servers, seen)})

    def death(self, settle_s: float = 20.0) -> Optional[str]:
        """Why a replica cannot serve (the first that cannot, named), else None."""
        return next((why for server in self.servers if (why := server.death(settle_s))), None)

    def stop(self, grace_s: float = TEARDOWN_GRACE_S) -> str:
        """Stop every replica (each however it was started); says how each ended."""
        ended = []
        for server in self.servers:
            if isinstance(server, ServerProcess):
                ended.append(f"{server.title}: pid {server.pid}, exit code {server.stop(grace_s)}")
            else:
                server.stop()
                ended.append(f"{server.title}: flow run {server.flow_run_id} cancelled")
        return "; ".join(ended)


def rollout_replicas(cfg: RLHFConfig, place: RunPlace, steps: Steps = DIRECT) -> Replicas:
    """Start the run's `deploy.rollout.replicas` rollout servers where deploy.rollout.launch says (not waited for);
    what started is stopped again when one fails to start."""
    count, servers = cfg.deploy.rollout.replicas, []
    try:
        for i in range(count):
            replica = i if count > 1 else None
            title = f"rollout server replica {i}" if count > 1 else "rollout server"
            if cfg.deploy.rollout.launch == "local":
                log = place.log_dir / ("rollout-server.log" if count == 1 else f"rollout-server-{i}.log")
                server = launch_rollout(cfg, log, secret=run_secret(place), trainer_host="127.0.0.1", replica=replica)
                steps.log(f"{title} starting: pid {server.pid}, {server.url}, log {server.log_path}")
            else:
                server = start_deployment("rollout", cfg, place, title)
                steps.log(f"{title}: started deployment rollout-server/default as flow run {server.flow_run_id}")
            servers.append(server)
    except BaseException:
        Replicas(servers).stop()
        raise
    return Replicas(servers)


def start_kubernetes(kind: str, cfg: RLHFConfig, place: RunPlace):
    """`kind`'s servers as a LeaderWorkerSet this run creates on its cluster (components/cluster/servers.py): the
    run's secret in a Secret of their own, the critic's store and restore point, the rollout server's trainer
    address; found through the LeaderWorkerSet's DNS names, deleted when they stop (or with the run's Job)."""
    args = {}
    if kind == "critic":
        args = {"checkpoint_uri": place.store_uri, "restore_iteration": place.critic_restore_iteration}
    if kind == "rollout":
        args = {"trainer_host": trainer_host(cfg)}
    return start_servers(kind, cfg, run_secret(place), probe_at(kind, cfg, run_secret(place)), place.run_name, **args)


# ------------------------------------------------------------------------------------------------ starting a server
@contextmanager
def started(kind: str, cfg: RLHFConfig, place: RunPlace, steps: Steps = DIRECT):
    """The `kind` server of the run, started where its section says (a child process, or its deployment), not yet
    ready; stopped after the block, first thing (a cancelled run must not wait on an in-flight request)."""
    secret = run_secret(place)  # made here, before a step may see a copy of `place`
    if kind == "rollout" and section(kind, cfg).launch != "kubernetes":  # a LeaderWorkerSet holds its replicas
        server = steps("deploy-rollout-server", rollout_replicas, cfg, place, steps)
    elif section(kind, cfg).launch == "local":
        critic_dir = {"checkpoint_dir": str(place.critic_dir)} if kind == "critic" and place.critic_dir else {}
        server = steps(f"deploy-{kind}-server", local_server, kind, cfg, place.log_dir / f"{kind}-server.log",
                       secret, **critic_dir)
        steps.log(f"{kind} server starting: pid {server.pid}, {server.url}, log {server.log_path}")
    elif section(kind, cfg).launch == "kubernetes":
        server = steps(f"deploy-{kind}-server", start_kubernetes, kind, cfg, place)
        steps.log(f"{kind} server: created {server.describe()}: {', '.join(server.urls)}")
    else:
        server = steps(f"deploy-{kind}-server", start_deployment, kind, cfg, place)
        steps.log(f"{kind} server: started deployment {kind}-server/default as flow run {server.flow_run_id}")
    try:
        yield server
    finally:
        # the run is done with it (a critic's saves are complete and atomic): a local server gets TEARDOWN_GRACE_S to
        # stop by itself, then it is killed (PyTriton's graceful stop spends ~6 s polling its unloaded models)
        if isinstance(server, Replicas):
            steps.log(f"rollout server stopped ({server.stop(TEARDOWN_GRACE_S)})")
        else:
            code = server.stop(TEARDOWN_GRACE_S) if isinstance(server, ServerProcess) else server.stop()
            steps.log(f"{kind} server stopped" + (f" (pid {server.pid}, exit code {code})"
                                                  if isinstance(server, ServerProcess)
                                                  else f" ({server.describe()} deleted)" if hasattr(server, "describe")
                                                  else f" (flow run {server.flow_run_id} cancelled)"))


def wait_ready(kind: str, server, cfg: RLHFConfig, steps: Steps = DIRECT) -> str:
    """Wait until the started server (every replica) serves, saying every ~30 s in the run's log what it waits for;
    returns its URL (the first replica's)."""
    started_at = time.monotonic()
    health = steps("wait-until-ready", server.wait_until_ready, section(kind, cfg).ready_timeout_s, steps.log)
    where = ", ".join(getattr(server, "urls", [server.url]))
    steps.log(f"{kind} server ready at {where} after {time.monotonic() - started_at:.1f}s"
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
def reward_service(cfg: RLHFConfig, place: RunPlace, steps: Steps = DIRECT, needed: bool = True) -> Iterator[Optional[Service]]:
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


def trainer_host(cfg: RLHFConfig) -> str:
    """Where the rollout server reaches this process (the weight-transfer group's store): loopback for a local
    server, this pod's address for a deployment."""
    return "127.0.0.1" if cfg.deploy.rollout.launch == "local" else advertised_host("0.0.0.0")


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
        worker = verifiers.VerifiersWorker(run_secret(place), place.log_dir / f"verifiers-{v.id}.log", env_paths=v.paths)
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


# ------------------------------------------------------------------------------------------------ the server flow side
def serve_published(kind: str, server: ServerProcess, url: str, lost: Callable[[], Optional[str]] = lambda: None,
                    poll_s: float = 2.0) -> Optional[str]:
    """Publish a ready server's `url` for the flow run that deployed this one (a Prefect variable named after this
    flow run), then serve until the server exits (a failure: raises naming it), this flow run is cancelled, or
    `lost()` says why the run it serves is gone (returns that reason); unpublish either way."""
    from prefect import get_run_logger  # heavy: as current_state's prefect (loaded already in a server's flow run)
    from prefect.runtime import flow_run  # heavy: as above
    from prefect.variables import Variable  # heavy: as above

    name = address_variable(flow_run.get_id())
    try:
        Variable.set(name, url, overwrite=True)
        get_run_logger().info(f"{kind} server ready at {url} (pid {server.pid}); serving until its run stops it")

        def done() -> Optional[str]:
            if server.poll() is not None:
                raise ServerDied(server.death())
            try:
                return lost()
            except Exception:  # noqa: BLE001 - the API hiccuped: the lease's timeout decides, not one failed look
                return None

        return wait_for(done, None, poll_s=poll_s)
    finally:
        try:
            Variable.unset(name)
        except Exception:  # noqa: BLE001 - best effort: the API may be going away with us
            pass


def advertised_host(bind: str) -> str:
    """The address other pods reach a server bound to `bind` at."""
    return os.environ.get(ADVERTISE_ENV) or (socket.gethostbyname(socket.gethostname()) if bind in ("0.0.0.0", "::") else bind)


def host_server(kind: str, cfg: RLHFConfig, checkpoint_uri: Optional[str] = None,
                restore_iteration: Optional[int] = None, secret_block: Optional[str] = None,
                training_flow_run_id: Optional[str] = None, trainer_host: Optional[str] = None,
                lease: Optional[str] = None) -> int:
    """Body of the critic-server, reward-server and rollout-server deployments: start the server with the run's
    secret (read from the Secret block `secret_block`), publish its address, serve until cancelled or until the run
    it serves is gone (its `lease` in the run's store is gone, or `training_flow_run_id` reached a final state): then
    the server is stopped and this flow run completes, saying why.

    The critic saves into a fresh directory of this flow run and uploads every save to the run's store at
    `checkpoint_uri`; with `restore_iteration` it starts from iter_<N>/critic of that store (any error doing so
    fails this flow run, and with it the training flow run, naming the URI and the cause). A rollout server sets up
    weight transfers with `trainer_host` only.
    """
    from prefect import get_run_logger  # heavy: as current_state's prefect (loaded already in a server's flow run)
    from prefect.runtime import flow_run  # heavy: as above

    logger = get_run_logger()
    server_dir = cfg.resolved_state_dir() / "servers" / f"{kind}-{flow_run.get_id()}"
    if secret_block:
        secret = load_secret(secret_block)
    elif kind != "rollout" and section(kind, cfg).auth == "none":
        secret = new_secret()  # open mode: guards the admin APIs only
    else:
        raise ValueError(f"{kind} server: no secret_block given: a run's server serves that run only (the run that "
                         f"deploys it names the Prefect Secret block holding the run's secret)")
    fields = {}
    if kind == "critic":
        fields = {"checkpoint_dir": str(server_dir / "critic"), "checkpoint_uri": checkpoint_uri,
                  "restore_iteration": restore_iteration}
    try:
        with local_server(kind, cfg, server_dir / f"{kind}-server.log", secret, trainer_host, **fields) as server:
            server.wait_until_ready(section(kind, cfg).ready_timeout_s)
            lost = lease_lost(lease, training_flow_run_id, s3_endpoint_url=cfg.deploy.checkpoint.s3_endpoint_url)
            why = serve_published(kind, server, f"http://{advertised_host(section(kind, cfg).host)}:{server.port}", lost)
            logger.warning(f"{kind} server: stopping: {why}")
    finally:
        shutil.rmtree(server_dir / "critic", ignore_errors=True)  # every save is in the store
        logger.info(f"{kind} server stopped")
    return 0
