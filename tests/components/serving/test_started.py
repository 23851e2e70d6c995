"""One server lifecycle, however a server was launched (components/serving/started.py): every launch mode a config
accepts has one start module whose servers are StartedServers, and the rollout server's local replicas are one
server: ready when every replica serves, dead when one is (named), stopped together, saying how each ended.

The replicas here are real HTTP servers (`python -m http.server`, a child process each, in its own process group)
looked at through the rollout server's own probe (GET /health), so no vLLM is needed; the rollout server's replicas
themselves train in tests/components/serving/test_vllm_training.py."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import get_args

from components.cluster.servers import KubeServers
from components.launch.processes import ServerProcess, alive, find_free_ports
from components.serving import kubernetes, local
from components.serving.launcher import rollout_probe
from components.serving.services import LAUNCHES
from components.serving.started import StartedServer
from models.deploy import RolloutPlacement, ServerPlacement


def test_every_launch_mode_a_server_section_accepts_has_one_start_module():
    modes = set(get_args(ServerPlacement.model_fields["launch"].annotation))
    modes |= set(get_args(RolloutPlacement.model_fields["launch"].annotation))
    assert set(LAUNCHES) == modes - {"in_process"} == {"local", "kubernetes"}  # in_process: no server at all
    assert LAUNCHES["local"] is local.start and LAUNCHES["kubernetes"] is kubernetes.start
    lws = KubeServers("critic", None, [{"kind": "LeaderWorkerSet", "metadata": {"name": "rlhf-demo-critic"}}],
                      ["http://rlhf-demo-critic-0.rlhf-demo-critic.rlhf:8000"], lambda url: None)
    assert isinstance(lws, StartedServer)  # LocalServers: below


def replica(directory: Path, i: int, tmp_path: Path) -> ServerProcess:
    port = find_free_ports(count=1)
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(directory)]
    return ServerProcess("rollout", argv, url, tmp_path / f"rollout-server-{i}.log", rollout_probe(url),
                         title=f"rollout server replica {i}")


def test_the_rollout_servers_replicas_are_one_server_ready_together_dead_when_one_is_and_stopped_together(tmp_path):
    served = tmp_path / "www"
    served.mkdir()
    (served / "health").write_text("ok")  # GET /health answers 200
    processes = [replica(served, i, tmp_path) for i in range(2)]
    servers = local.LocalServers("rollout", processes)
    try:
        assert isinstance(servers, StartedServer)
        assert servers.urls == [p.url for p in processes] and servers.url == processes[0].url
        assert servers.describe() == "; ".join(f"rollout server replica {i}: pid {p.pid}, {p.url}, log {p.log_path}"
                                               for i, p in enumerate(processes))
        health = servers.wait_until_ready(120)
        assert health.ok and set(health.info) == {"rollout server replica 0", "rollout server replica 1"}
        assert servers.death() is None
        os.kill(processes[1].pid, signal.SIGKILL)
        death = servers.death(settle_s=30)
        assert re.match(rf"rollout server replica 1 \(pid {processes[1].pid}, {processes[1].url}\) exited with code -9",
                        death or ""), death
    finally:
        ended = servers.stop(5.0)
    assert ended == (f"rollout server replica 0 (pid {processes[0].pid}): exit code {-signal.SIGTERM}; "
                     f"rollout server replica 1 (pid {processes[1].pid}): exit code {-signal.SIGKILL}")
    assert not [p.pid for p in processes if alive(p.pid)]
    assert servers.stop(5.0) == ended  # twice: nothing left, the same answer
