"""Start the vLLM rollout server (rollout_server.py) for a run, connect the actor's engine to it, stop it afterwards.

The server runs in its own environment (`rollout.vllm.python`, `.venv-vllm` from `make vllm-venv`) as a
`ChildProcess` in its own process group, logging to a file. It loads the policy's base checkpoint; before the first
rollout the actor sends it its current weights (a new run's, a resumed run's checkpoint, LoRA merged), so a resumed run
samples from the checkpointed actor. After that the training step refits it after every update.

Readiness is GET /health answering 200 (the engine is loaded before the HTTP server starts). A server that dies is
named with its exit code and log tail, within `settle_s`, by `death()`, which the flow's guard calls when a step fails.
"""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import httpx
import torch

from components.launch.processes import PROJECT_ROOT, ChildProcess, find_free_ports, port_block_free, project_env, wait_for
from models.config import RLHFConfig
from models.rollout import ENGINES
from models.rollout.vllm import RolloutClient

SERVER_MODULE = "components.serving.rollout_server"


class RolloutServerNotReady(RuntimeError):
    """The rollout server did not answer /health in time, or exited first; the message says which and shows its log."""


def server_python(cfg: RLHFConfig) -> str:
    """The interpreter of the server's environment; a clear error when it is missing."""
    python = Path(cfg.rollout.vllm.python)
    python = python if python.is_absolute() else PROJECT_ROOT / python
    if not python.exists():
        raise FileNotFoundError(f"rollout.vllm.python: {python} does not exist; build the vLLM environment with "
                                f"`make vllm-venv` (or point it at an interpreter that has vllm)")
    return str(python)


def server_argv(cfg: RLHFConfig, port: int, host: Optional[str] = None) -> list[str]:
    v = cfg.rollout.vllm
    argv = [server_python(cfg), "-m", SERVER_MODULE, "--model", str(cfg.resolve_model_path(cfg.model.policy)),
            "--host", host or v.host, "--port", str(port), "--dtype", v.dtype, "--seed", str(cfg.seed),
            "--gpu-memory-utilization", str(v.gpu_memory_utilization)]
    argv += ["--max-model-len", str(v.max_model_len)] if v.max_model_len else []
    return argv + (["--enforce-eager"] if v.enforce_eager else [])


def server_env(cfg: RLHFConfig) -> dict[str, str]:
    v = cfg.rollout.vllm
    # a CPU-only host: every core (the actor's ranks wait while the server generates, and the server idles while they
    # train); vLLM on 1 of 2 cores generated 1.27x the native engine's tokens/s, on both 1.89x (benchmarks/rollout_engine)
    threads = v.threads or (os.cpu_count() if not torch.cuda.is_available() else None)
    extra = {"VLLM_CPU_KVCACHE_SPACE": f"{v.kv_cache_gib:g}", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if threads:
        extra["OMP_NUM_THREADS"] = str(threads)
    env = project_env(extra)
    for leaked in ("VIRTUAL_ENV", "PYTHONHOME"):  # the server's interpreter brings its own environment
        env.pop(leaked, None)
    return env


def free_port(host: str, preferred: int) -> int:
    """The configured port if free, else (or for 0) a free one (two runs on one machine must not collide)."""
    bind = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return preferred if preferred and port_block_free(bind, preferred, 1) else find_free_ports(bind, count=1)


def wait_health(url: str, timeout: float, process: Optional[ChildProcess] = None, instance: Optional[str] = None) -> dict:
    """Poll GET /health until it answers 200 and return its answer; fail early, with the log tail, if `process` (the
    server, when it is our child) exits first, or if another server (not `instance`) answers at `url`."""
    last = ["nothing listening yet"]

    def ready():
        if process is not None and (code := process.poll()) is not None:
            raise RolloutServerNotReady(f"rollout server exited with code {code} before it was ready; last lines of "
                                        f"{process.log_path}:\n{process.tail()}")
        try:
            response = httpx.get(f"{url}/health", timeout=2.0)
            if response.status_code == 200:
                info = response.json()
                if instance is not None and info.get("instance") != instance:
                    raise RolloutServerNotReady(f"another rollout server answers at {url} (not the one started "
                                                f"here, pid {process.pid if process else '?'}): its port was taken")
                return info
            last[0] = f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            last[0] = f"{type(exc).__name__}: {exc}"
        return None

    info = wait_for(ready, timeout, poll_s=0.5)
    if not info:
        tail = f"; last lines of {process.log_path}:\n{process.tail()}" if process is not None else ""
        raise RolloutServerNotReady(f"rollout server at {url} not ready after {timeout:.0f}s ({last[0]}){tail}")
    return info


class RolloutServer(ChildProcess):
    """The rollout server as a child process in its own process group (a context manager that stops it)."""

    name = "rollout"

    def __init__(self, cfg: RLHFConfig, log_path: str | Path, host: Optional[str] = None):
        v = cfg.rollout.vllm
        host = host or v.host
        self.port = free_port(host, v.port)
        connect = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.url = f"http://{connect}:{self.port}"
        self.instance = secrets.token_hex(8)
        super().__init__(server_argv(cfg, self.port, host) + ["--instance", self.instance], log_path, server_env(cfg))

    def wait_until_ready(self, timeout: float) -> dict:
        return wait_health(self.url, timeout, self, self.instance)

    def death(self, settle_s: float = 20.0) -> Optional[str]:
        """A message naming the server, its exit code and log tail if it is gone (else None); called after a request
        failed: a killed server drops its connections a moment before its exit is seen."""
        if self.poll() is None and self.answers():
            return None  # alive and serving: the failure was not this server's
        wait_for(lambda: self.poll() is not None, settle_s)
        if (code := self.poll()) is None:
            return None
        return (f"rollout server (pid {self.pid}, {self.url}) exited with code {code}; last lines of {self.log_path}:"
                f"\n{self.tail()}")

    def answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def __enter__(self) -> "RolloutServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def connect(actor, url: str, cfg: RLHFConfig) -> RolloutClient:
    """Point rank 0's engine at the server and send it the actor's current weights (all ranks gather them)."""
    client = RolloutClient(url, cfg.rollout.vllm.request_timeout_s)
    try:
        actor.state.engine.connect(client)
        actor.refit()
    except BaseException:
        client.close()
        raise
    return client


@contextmanager
def local_rollout_server(cfg: RLHFConfig, log_dir: Path) -> Iterator[Optional[RolloutServer]]:
    """For an engine with its own weights: a local rollout server process for the block (None for the native engine).
    Start it before the actor, so that both load side by side, then `attach` the actor. The in-process entry point
    (`rlhf train`) uses this; the flows use serving.services, which adds launch=deployment and Prefect tasks around
    the same steps."""
    if ENGINES[cfg.rollout.engine].shares_actor_weights:
        yield None
        return
    with RolloutServer(cfg, Path(log_dir) / "rollout-server.log") as server:
        yield server


@contextmanager
def attach(server: Optional[RolloutServer], actor, cfg: RLHFConfig) -> Iterator[None]:
    """Wait until `server` is ready, connect the actor's engine to it and send it the actor's weights (nothing for
    None); the client is closed after the block."""
    if server is None:
        yield
        return
    server.wait_until_ready(cfg.rollout.vllm.ready_timeout_s)
    client = connect(actor, server.url, cfg)
    try:
        yield
    finally:
        client.close()
