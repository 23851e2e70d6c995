"""How each kind of server of a run starts as a `ServerProcess` (components/launch/processes.py) and how it is probed.

Critic and reward servers (PyTriton): the child runs
`python -m components.serving.triton.main --spec <ServerSpec JSON>`; readiness is Triton's server and model readiness
(`triton_probe`). The launcher handles the environment's traps:
- PyTriton's "one script per machine" known issue: two PyTriton servers on one machine collide on the default ports
  8000-8002, and could share python-backend shared-memory names and workspaces. Each child gets its own port P (its
  front; Triton itself listens on a Unix socket in its workspace, no gRPC or metrics port), its own PYTRITON_HOME (a
  fresh temp dir, removed on stop); PyTriton 0.7 already makes the shared-memory prefix unique per process. A killed
  Triton cannot remove its shared memory: stop does.
- Security (components/serving/auth.py): the child gets the run's secret in its environment ($RLHF_RUN_SECRET; a new
  one when the caller gives none), never on its command line; with it, every request but health must be signed with
  the run's key (open mode: inference, config and metadata answer anyone). Readiness checks have the server prove
  it holds the run's secret, use the health API, and read the repository summary (a model's state and failure
  reason) with a signed request.

The rollout server (vLLM, components/serving/rollout/) runs in its own environment (`deploy.rollout.python`,
`.venv-vllm` from `make vllm-venv`); readiness is GET /health answering 200 with the launcher's token (`rollout_probe`:
another server at the port is named as such; a server whose weights broke after a failed update answers 503, so it
is not healthy; a server that cannot prove it holds the run's secret is another server). It gets the run's secret in
its environment too, and the one address its weight-transfer group may be set up with (--trainer-host: the
trainer's).

A server the run did not start as its child (a pod of a LeaderWorkerSet: components/cluster/servers.py) is looked at
through the same probes (`probe_at`); the rollout server there reaches the trainer at this pod's address
(`trainer_host`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence
from urllib.parse import urlparse

import httpx
import torch

from components.launch.processes import (OWN_DIR_ENV, PARENT_PID_ENV, PROJECT_ROOT, Health, Probe, ServerNotReady,
                                         ServerProcess, free_port, project_env)
from components.serving.auth import new_secret, read_secret, secret_env
from components.serving.triton.contract import ServerSpec
from components.serving.triton.front import MODELS_PATH
from components.serving.triton.serve import model_state_summary
from components.handshake import ServerNotProven, run_client
from models.config import RLHFConfig, merge

ROLLOUT_SERVER_MODULE = "components.serving.rollout.main"


def connect_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host` (a wildcard: loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


# ---------------------------------------------------------------- PyTriton critic / reward servers

def child_env(home: Path, secret: str, extra: Optional[dict] = None) -> dict[str, str]:
    """Environment of a server child: `home` its own (PYTRITON_HOME; the child removes it if this process dies without
    stopping it), the run's secret, this process as the parent it must not outlive, project importable (the child
    puts this interpreter's libpython first on LD_LIBRARY_PATH for Triton itself: triton/serve.prepare_environment)."""
    return project_env({"PYTRITON_HOME": str(home), OWN_DIR_ENV: str(home), **secret_env(secret),
                        PARENT_PID_ENV: str(os.getpid()), "DO_NOT_TRACK": os.environ.get("DO_NOT_TRACK", "1"),
                        **(extra or {})})


def _model_state(client: httpx.Client, name: str) -> tuple[str, bool]:
    """(description, failed) of a model that is not ready.

    With the run's key, the server's repository summary (GET /rlhf/models: Triton's repository index, read by the
    front) names a model whose load failed (state UNAVAILABLE + reason: our servers register a model that cannot load
    its weights there) and a bound model's state (PyTriton writes it into the repository, then loads it). A model not
    in it yet: the model config tells 'not found' (not bound yet, weights loading) from 'no available versions'
    (Triton is loading it, or its load failed).
    """
    index = client.get(MODELS_PATH)
    summary = model_state_summary(index.json(), name) if index.status_code == 200 else None
    if summary is not None:
        return f"state {summary}", summary.startswith("UNAVAILABLE") and "unloaded" not in summary
    config = client.get(f"/v2/models/{name}/config")
    if config.status_code == 200:
        return "state unknown: its config is served but it is not ready", False
    try:
        error = config.json().get("error", config.text)
    except ValueError:
        error = config.text
    if "no available versions" in error:
        return "state UNAVAILABLE: loading, or its load failed (see the server log)", False
    if "not found" in error:
        return "state not loaded: the server is still loading weights", False
    return f"state unknown: {error}".strip(), False


def triton_probe(url: str, models: Iterable[str], secret: Optional[str] = None, timeout_s: float = 2.0) -> Probe:
    """Server liveness, each model's readiness and server readiness. What it sees tells apart: nothing listening at
    host:port; server up but model X not ready (state ...); a server that accepts connections but does not answer.
    With the run's `secret`, the server must first prove it holds it (another server at the address is named as
    such), and a model whose load failed raises at once instead of waiting out the timeout."""
    where = urlparse(url if "://" in url else f"http://{url}").netloc
    models = tuple(models)

    def probe() -> Health:
        client = run_client(secret, "triton", base_url=f"http://{where}", timeout=timeout_s)
        try:
            live = client.get("/v2/health/live").status_code == 200
            pending = [m for m in models if client.get(f"/v2/models/{m}/ready").status_code != 200]
            if live and not pending and client.get("/v2/health/ready").status_code == 200:
                return Health(True, "ready")
            if not pending:
                return Health(False, f"server up at {where} but not ready (live={live})")
            state, failed = _model_state(client, pending[0])
            status = f"server up at {where} but model {pending[0]} not ready ({state})"
            if failed:
                raise ServerNotReady(status, "not_ready")
            return Health(False, status)
        except ServerNotProven as exc:
            raise ServerNotReady(str(exc), "wrong_server") from None
        except httpx.ConnectError as exc:
            return Health(False, f"nothing listening at {where} ({exc})", "not_listening")
        except httpx.TimeoutException as exc:
            return Health(False, f"server at {where} accepted the connection but did not answer "
                                 f"({type(exc).__name__})", "timeout")
        except httpx.RemoteProtocolError as exc:  # it read the request and closed the connection: going away
            return Health(False, f"server at {where} closed the connection while answering ({exc})", "not_listening")
        except httpx.TransportError as exc:  # reset, unreachable: the network said no
            return Health(False, f"cannot reach {where}: {type(exc).__name__}: {exc}", "not_listening")
        finally:
            client.close()
    return probe


def triton_server(argv: Sequence[str], host: str, port: int, models: Iterable[str], log_path: str | Path,
                  name: str = "server", env: Optional[dict] = None, secret: Optional[str] = None) -> ServerProcess:
    """A PyTriton server child (`argv` serves on host:port) with its own PYTRITON_HOME and the run's `secret` (None:
    this process's $RLHF_RUN_SECRET, else a new one; `server.secret`), probed for `models`; stopping it also removes
    its workspace and the shared memory a killed Triton leaves."""
    secret = secret or read_secret() or new_secret()
    home = Path(tempfile.mkdtemp(prefix=f"rlhf-{name}-"))  # short: unix socket paths live in here
    url = f"http://{connect_host(host)}:{port}"

    def cleanup(proc: ServerProcess) -> None:
        shutil.rmtree(home, ignore_errors=True)
        # python-backend shared memory is named after the server's pid; a killed Triton cannot remove it itself
        for leftover in Path("/dev/shm").glob(f"pytrtion{proc.pid}-*"):
            leftover.unlink(missing_ok=True)

    try:
        server = ServerProcess(name, argv, url, log_path, triton_probe(url, models, secret),
                               child_env(home, secret, env), on_stop=cleanup)
        server.secret = secret  # what its clients send (components/serving/auth.py)
        return server
    except BaseException:
        shutil.rmtree(home, ignore_errors=True)
        raise


def server_argv(spec: ServerSpec) -> list[str]:
    """Command line of a server child: the whole ServerSpec as one JSON document."""
    return [sys.executable, "-m", "components.serving.triton.main", "--spec", spec.model_dump_json()]


def launch(spec: ServerSpec, log_path: str | Path, wait: bool = True, secret: Optional[str] = None) -> ServerProcess:
    """Start the server of `spec` as a child process holding the run's `secret` (a new one when None) and, by
    default, wait until it is ready (stopping it if not).

    The child resolves model paths against the same state directory as this process (made explicit in the spec).
    """
    cfg = spec.config
    spec = spec.model_copy(update={"config": merge(cfg, {"deploy.state_dir": str(cfg.resolved_state_dir())})})
    proc = triton_server(server_argv(spec), spec.host, spec.port, spec.models, log_path, name=spec.kind,
                         secret=secret)
    if not wait:
        return proc
    try:
        proc.wait_until_ready(spec.section.ready_timeout_s)
        return proc
    except BaseException:
        proc.stop()
        raise


# ---------------------------------------------------------------- the vLLM rollout server

def rollout_python(cfg: RLHFConfig) -> str:
    """The interpreter of the rollout server's environment; a clear error when it is missing."""
    python = Path(cfg.deploy.rollout.python)
    python = python if python.is_absolute() else PROJECT_ROOT / python
    if not python.exists():
        raise FileNotFoundError(f"deploy.rollout.python: {python} does not exist; build the vLLM environment with "
                                f"`make vllm-venv` (or point it at an interpreter that has vllm)")
    return str(python)


def rollout_argv(cfg: RLHFConfig, port: int, host: Optional[str] = None, instance: str = "",
                 trainer_host: str = "127.0.0.1") -> list[str]:
    """The rollout server's command line (no secret on it: the secret goes in its environment, `rollout_env`)."""
    v = cfg.deploy.rollout
    argv = [rollout_python(cfg), "-m", ROLLOUT_SERVER_MODULE, "--model", cfg.local_path("model.policy"),
            "--host", host or v.host, "--port", str(port), "--dtype", cfg.rollout.vllm.dtype, "--seed", str(cfg.seed),
            "--gpu-memory-utilization", str(v.gpu_memory_utilization), "--instance", instance,
            "--trainer-host", trainer_host, "--max-request-sequences", str(v.max_request_sequences),
            "--max-request-tokens", str(v.max_request_tokens), "--max-body-mib", str(v.max_body_mib)]
    argv += ["--max-model-len", str(v.max_model_len)] if v.max_model_len else []
    argv += ["--cpu-cores", v.cpu_cores] if v.cpu_cores else []
    argv += ["--tensor-parallel-size", str(v.tensor_parallel_size)] if v.tensor_parallel_size > 1 else []
    return argv + (["--enforce-eager"] if v.enforce_eager else [])


def rollout_env(cfg: RLHFConfig, secret: Optional[str] = None) -> dict[str, str]:
    """The rollout server's environment: its threads and KV cache, the run's `secret`, this process as the parent it
    must not outlive."""
    v = cfg.deploy.rollout
    # a CPU-only host: every core (the actor's ranks wait while the server generates, and the server idles while they
    # train); vLLM on 1 of 2 cores generated 1.27x the native engine's tokens/s, on both 1.89x
    # (benchmarks/rollout_engine)
    threads = v.threads or (len(os.sched_getaffinity(0)) if not torch.cuda.is_available() else None)
    extra = {"VLLM_CPU_KVCACHE_SPACE": f"{v.kv_cache_gib:g}", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
             PARENT_PID_ENV: str(os.getpid()), **(secret_env(secret) if secret else {})}
    if threads:
        extra["OMP_NUM_THREADS"] = str(threads)
    if v.cpu_cores:
        extra["VLLM_CPU_OMP_THREADS_BIND"] = v.cpu_cores
    env = project_env(extra)
    for leaked in ("VIRTUAL_ENV", "PYTHONHOME"):  # the server's interpreter brings its own environment
        env.pop(leaked, None)
    return env


def rollout_probe(url: str, instance: Optional[str] = None, timeout_s: float = 2.0,
                  secret: Optional[str] = None) -> Probe:
    """GET /health: 200 with the server's description (model, weights version, run, ...) when it serves; 503 with
    why while its weights are broken (a failed update). With `instance` (the launcher's token, echoed by the server),
    or with the run's `secret` (the server must prove it holds it first), another server answering at `url` is
    refused: its port was taken."""

    def probe() -> Health:
        try:
            with run_client(secret, "rollout", timeout=timeout_s) as client:
                response = client.get(f"{url}/health")
        except ServerNotProven as exc:
            raise ServerNotReady(str(exc), "wrong_server") from None
        except httpx.ConnectError as exc:
            return Health(False, f"nothing listening at {url} ({exc})", "not_listening")
        except httpx.TimeoutException as exc:
            return Health(False, f"server at {url} did not answer /health ({type(exc).__name__})", "timeout")
        except httpx.HTTPError as exc:
            return Health(False, f"cannot reach {url}: {type(exc).__name__}: {exc}", "not_listening")
        try:
            info = response.json()
        except ValueError:
            info = {}
        if instance is not None and info.get("instance") not in (None, instance):
            raise ServerNotReady(f"another rollout server answers at {url} (not the one started here): its port was "
                                 f"taken", "wrong_server")
        if response.status_code == 200:
            return Health(True, "ready", info=info)
        return Health(False,
                      f"/health answered {response.status_code}: "
                      f"{info.get('detail') or info.get('broken') or response.text[:200]}",
                      info=info)
    return probe


def check_tensor_parallel(cfg: RLHFConfig) -> None:
    """A rollout server sharded over GPUs needs them on the host it starts on: refused on a CPU host, naming the
    field."""
    tp = cfg.deploy.rollout.tensor_parallel_size
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if tp > 1 and gpus < tp:
        raise ValueError(f"deploy.rollout.tensor_parallel_size={tp}: the rollout server shards the model over {tp} "
                         f"GPUs, and this host has {gpus}"
                         + (" (a CPU host runs tensor_parallel_size=1)" if not gpus else ""))


def launch_rollout(cfg: RLHFConfig, log_path: str | Path, host: Optional[str] = None, secret: Optional[str] = None,
                   trainer_host: str = "127.0.0.1", replica: Optional[int] = None) -> ServerProcess:
    """Start the rollout server of `cfg` as a child process (not waiting for it) holding the run's `secret` (None:
    this process's $RLHF_RUN_SECRET, else a new one; `server.secret`), setting up weight transfers with `trainer_host`
    only: on `deploy.rollout.port` (replica i: port + i), or a free port when that one is busy, 0 or None. `replica`:
    its index among the run's replicas, which names it ('rollout server replica i')."""
    check_tensor_parallel(cfg)
    host = host or cfg.deploy.rollout.host
    base = cfg.deploy.rollout.port
    port = free_port(host, base + (replica or 0) if base else base)
    instance = secrets.token_hex(8)
    secret = secret or read_secret() or new_secret()
    url = f"http://{connect_host(host)}:{port}"
    server = ServerProcess("rollout", rollout_argv(cfg, port, host, instance, trainer_host), url, log_path,
                           rollout_probe(url, instance, secret=secret), rollout_env(cfg, secret),
                           title=None if replica is None else f"rollout server replica {replica}")
    server.secret = secret
    return server


# ---------------------------------------------------------------- servers found at a URL (not our children)

def probe_at(kind: str, cfg: RLHFConfig, secret: Optional[str] = None) -> Callable[[str], Probe]:
    """How to look at a `kind` server found at a URL (a pod's; with the run's `secret`, the server must prove it holds
    it, and a model that is not ready is looked up in its repository summary, which names why)."""
    if kind == "rollout":
        return lambda url: rollout_probe(url, secret=secret)
    models = ServerSpec(kind=kind, config=cfg).models
    return lambda url: triton_probe(url, models, secret)


ADVERTISE_ENV = "RLHF_ADVERTISE_HOST"  # the address other pods reach this one at, when the default guess is wrong


def advertised_host() -> str:
    """The address other pods reach this pod at (its hostname's address, unless $RLHF_ADVERTISE_HOST says)."""
    return os.environ.get(ADVERTISE_ENV) or socket.gethostbyname(socket.gethostname())


def trainer_host(cfg: RLHFConfig) -> str:
    """Where the rollout server reaches this process (the weight-transfer group's store): loopback for a local
    server, this pod's address for one on Kubernetes."""
    return "127.0.0.1" if cfg.deploy.rollout.launch == "local" else advertised_host()
