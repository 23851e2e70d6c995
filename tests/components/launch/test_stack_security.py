"""The local stack's Prefect and MLflow servers, started with the settings `rlhf up` gives them: a web page from
another origin gets no CORS grant and cannot change state without a CSRF token (Prefect) or a Host/Origin of the
stack's own (MLflow), while Prefect's own client and CLI, and MLflow's tracking client, keep working."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from components.launch import stack
from components.launch.processes import ChildProcess, find_free_ports, wait_for

EVIL = "http://evil.example"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    state = tmp_path_factory.mktemp("stack")
    prefect_port, mlflow_port = find_free_ports(count=1), find_free_ports(count=1)
    env = stack.base_env(state, prefect_port, mlflow_port)
    prefect_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    prefect_env.update(PREFECT_HOME=str(state / "prefect"), **stack.prefect_server_env(prefect_port))
    procs = [ChildProcess([stack.bin_path("prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                           str(prefect_port)], state / "prefect.log", prefect_env),
             ChildProcess([stack.bin_path("mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
                           "--backend-store-uri", f"sqlite:///{state / 'mlflow.db'}", "--artifacts-destination",
                           str(state / "artifacts"), "--workers", "1", *stack.mlflow_security_args(mlflow_port)],
                          state / "mlflow.log", env)]
    urls = {"prefect": f"http://127.0.0.1:{prefect_port}", "mlflow": f"http://127.0.0.1:{mlflow_port}", "env": env}
    try:
        for (name, url), proc in zip((("prefect", f"{urls['prefect']}/api/health"), ("mlflow", f"{urls['mlflow']}/health")),
                                     procs):
            assert wait_for(lambda: proc.poll() is not None or stack._healthy(url), 120, poll_s=0.5) and proc.poll() is None, \
                proc.tail()
        yield urls
    finally:
        for proc in procs:
            proc.stop()


def test_prefect_refuses_other_origins_and_changes_without_a_csrf_token(servers):
    api = f"{servers['prefect']}/api"
    own = stack.own_origins(int(servers["prefect"].rsplit(":", 1)[1]))[0]
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    evil = httpx.options(f"{api}/deployments/filter", headers={"Origin": EVIL, **preflight}, timeout=10)
    assert evil.headers.get("access-control-allow-origin") not in (EVIL, "*")
    mine = httpx.options(f"{api}/deployments/filter", headers={"Origin": own, **preflight}, timeout=10)
    assert mine.headers.get("access-control-allow-origin") == own
    # a simple (no preflight) cross-site POST still reaches the server: CSRF protection refuses it
    forged = httpx.post(f"{api}/variables/", json={"name": "forged", "value": "x"},
                        headers={"Origin": EVIL}, timeout=10)
    assert forged.status_code == 403 and "CSRF" in forged.json()["detail"]
    assert stack.prefect_post(api, "/flow_runs/filter", {"limit": 1}).status_code == 200


def test_prefects_own_client_and_cli_work_with_csrf_on(servers):
    env = {**os.environ, **servers["env"]}
    script = ("from prefect.variables import Variable; Variable.set('rlhf_csrf_probe', 'ok', overwrite=True); "
              "print(Variable.get('rlhf_csrf_probe'))")
    client = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert client.returncode == 0 and client.stdout.strip().endswith("ok"), client.stderr
    cli = subprocess.run([stack.bin_path("prefect"), "variable", "set", "rlhf_cli_probe", "yes", "--overwrite"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr


def test_mlflow_refuses_foreign_hosts_and_origins(servers):
    url = servers["mlflow"]
    search = "/api/2.0/mlflow/experiments/search"
    assert httpx.post(f"{url}{search}", json={"max_results": 1}, timeout=10).status_code == 200
    rebound = httpx.post(f"{url}{search}", json={"max_results": 1}, headers={"Host": "evil.example"}, timeout=10)
    assert rebound.status_code in (400, 403), rebound.text  # DNS rebinding: a Host that is not the stack's
    cross = httpx.post(f"{url}{search}", json={"max_results": 1}, headers={"Origin": EVIL}, timeout=10)
    assert cross.status_code == 403 or cross.headers.get("access-control-allow-origin") not in (EVIL, "*")
    import mlflow

    client = mlflow.tracking.MlflowClient(url)
    experiment = client.create_experiment("stack-security")
    assert client.get_experiment(experiment).name == "stack-security"
