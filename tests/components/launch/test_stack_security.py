"""The local stack's Prefect and MLflow servers, started with the settings `rlhf up` gives them:
- any local user reaches 127.0.0.1, so both refuse a request without the stack's credentials (made at random once,
  kept 0600 in the state dir, reaching processes through their environment only), while Prefect's own client and
  CLI, MLflow's tracking client and both UIs (which ask for them) keep working;
- a web page from another origin gets no CORS grant and cannot change state without a CSRF token (Prefect) or a
  Host/Origin of the stack's own (MLflow)."""

from __future__ import annotations

import os
import stat
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
    creds = stack.credentials(stack.stack_dir(state), create=True)  # what `rlhf up` does first
    prefect_port, mlflow_port = find_free_ports(count=1), find_free_ports(count=1)
    env = stack.base_env(state, prefect_port, mlflow_port)
    prefect_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    prefect_env.update(PREFECT_HOME=str(state / "prefect"), **stack.prefect_server_env(prefect_port, creds))
    procs = [ChildProcess([stack.bin_path("prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                           str(prefect_port)], state / "prefect.log", prefect_env),
             ChildProcess([stack.bin_path("mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
                           "--backend-store-uri", f"sqlite:///{state / 'mlflow.db'}", "--artifacts-destination",
                           str(state / "artifacts"), "--workers", "1", *stack.mlflow_security_args(mlflow_port)],
                          state / "mlflow.log", {**env, **stack.mlflow_server_env(state, creds)})]
    urls = {"prefect": f"http://127.0.0.1:{prefect_port}", "mlflow": f"http://127.0.0.1:{mlflow_port}", "env": env,
            "creds": creds, "state": state, "procs": procs}
    try:
        for (name,
             url), proc in zip((("prefect", f"{urls['prefect']}/api/health"), ("mlflow", f"{urls['mlflow']}/health")),
                                     procs):
            assert wait_for(lambda: proc.poll() is not None or stack._healthy(url), 120,
                            poll_s=0.5) and proc.poll() is None, \
                proc.tail()
        yield urls
    finally:
        for proc in procs:
            proc.stop()


def test_the_credentials_are_made_once_kept_0600_and_on_no_command_line(servers):
    path = stack.stack_dir(servers["state"]) / stack.CREDENTIALS
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stack.credentials(stack.stack_dir(servers["state"])) == servers["creds"]  # the same ever after
    secrets = [servers["creds"][k] for k in ("prefect", "mlflow_password", "mlflow_flask_key")]
    for proc in servers["procs"]:
        cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read().decode(errors="replace")
        assert not any(s in cmdline for s in secrets)
        assert not any(s in proc.tail(100_000) for s in secrets)  # nor in their logs
    assert stat.S_IMODE((servers["state"] / "mlflow" / "auth.ini").stat().st_mode) == 0o600
    assert not any(s in (servers["state"] / "mlflow" / "auth.ini").read_text() for s in secrets)
    assert servers["env"]["PREFECT_API_AUTH_STRING"] == servers["creds"]["prefect"]  # base_env: what runs on it
    path.chmod(0o644)  # loosened by hand: tightened again when read
    assert stack.credentials(stack.stack_dir(servers["state"])) == servers["creds"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_prefect_refuses_requests_without_the_stacks_credentials(servers, monkeypatch):
    api = f"{servers['prefect']}/api"
    body = {"limit": 1}
    auth = stack.basic_auth(servers["creds"]["prefect"])
    for headers in ({}, stack.basic_auth("rlhf:guessed"), stack.basic_auth(servers["creds"]["prefect"] + "x")):
        for path in ("/variables/name/rlhf_probe", "/csrf-token?client=x"):  # reads, and the CSRF token a write needs
            answer = httpx.get(f"{api}{path}", headers=headers, timeout=10)
            assert answer.status_code == 401, (path, answer.text)
        answer = httpx.post(f"{api}/flow_runs/filter", json=body, headers=headers, timeout=10)
        assert answer.status_code in (401, 403), answer.text  # no token to be had: CSRF refuses first
    assert httpx.get(f"{api}/health", timeout=10).status_code == 200  # liveness needs none
    assert httpx.get(f"{api}/variables/name/rlhf_probe", headers=auth, timeout=10).status_code == 404  # it is in
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", servers["creds"]["prefect"])
    assert stack.prefect_post(api, "/flow_runs/filter", body).status_code == 200
    assert stack.prefect_get(api, "/variables/name/rlhf_probe").status_code == 404
    # the UI asks for them (its login form: BASIC)
    assert httpx.get(f"{servers['prefect']}/ui-settings", timeout=10).json()["auth"] == "BASIC"


def test_prefect_refuses_other_origins_and_changes_without_a_csrf_token(servers, monkeypatch):
    api = f"{servers['prefect']}/api"
    auth = stack.basic_auth(servers["creds"]["prefect"])
    own = stack.own_origins(int(servers["prefect"].rsplit(":", 1)[1]))[0]
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    evil = httpx.options(f"{api}/deployments/filter", headers={"Origin": EVIL, **preflight}, timeout=10)
    assert evil.headers.get("access-control-allow-origin") not in (EVIL, "*")
    mine = httpx.options(f"{api}/deployments/filter", headers={"Origin": own, **preflight}, timeout=10)
    assert mine.headers.get("access-control-allow-origin") == own
    # a simple (no preflight) cross-site POST still reaches the server: CSRF protection refuses it, credentials or not
    forged = httpx.post(f"{api}/variables/", json={"name": "forged", "value": "x"},
                        headers={"Origin": EVIL, **auth}, timeout=10)
    assert forged.status_code == 403 and "CSRF" in forged.json()["detail"]
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", servers["creds"]["prefect"])
    assert stack.prefect_post(api, "/flow_runs/filter", {"limit": 1}).status_code == 200


def test_prefects_own_client_and_cli_work_with_the_credentials_and_csrf_on(servers):
    env = {**os.environ, **servers["env"]}
    script = ("from prefect.variables import Variable; Variable.set('rlhf_csrf_probe', 'ok', overwrite=True); "
              "print(Variable.get('rlhf_csrf_probe'))")
    client = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert client.returncode == 0 and client.stdout.strip().endswith("ok"), client.stderr
    cli = subprocess.run([stack.bin_path("prefect"), "variable", "set", "rlhf_cli_probe", "yes", "--overwrite"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    without = {k: v for k, v in env.items() if k != "PREFECT_API_AUTH_STRING"}
    refused = subprocess.run([stack.bin_path("prefect"), "variable", "set", "rlhf_cli_probe", "no", "--overwrite"],
                             env=without, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "401" in refused.stdout + refused.stderr


def test_mlflow_refuses_requests_without_the_stacks_credentials_and_foreign_hosts(servers, monkeypatch):
    url, creds = servers["mlflow"], servers["creds"]
    search = "/api/2.0/mlflow/experiments/search"
    auth = (creds["mlflow_user"], creds["mlflow_password"])
    for who in (None, (creds["mlflow_user"], "guessed")):
        assert httpx.post(f"{url}{search}", json={"max_results": 1}, auth=who, timeout=10).status_code == 401
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # liveness needs none
    assert httpx.post(f"{url}{search}", json={"max_results": 1}, auth=auth, timeout=10).status_code == 200
    ui = httpx.get(f"{url}/", timeout=10)  # the UI: the browser asks for them
    assert ui.status_code == 401 and ui.headers["www-authenticate"].startswith("Basic")
    assert httpx.get(f"{url}/", auth=auth, timeout=10).status_code == 200
    rebound = httpx.post(f"{url}{search}", json={"max_results": 1}, headers={"Host": "evil.example"}, auth=auth,
                         timeout=10)
    assert rebound.status_code in (400, 403), rebound.text  # DNS rebinding: a Host that is not the stack's
    cross = httpx.post(f"{url}{search}", json={"max_results": 1}, headers={"Origin": EVIL}, auth=auth, timeout=10)
    assert cross.status_code == 403 or cross.headers.get("access-control-allow-origin") not in (EVIL, "*")
    import mlflow

    for name, value in stack.client_env(creds).items():  # what base_env gives the stack's processes
        monkeypatch.setenv(name, value)
    client = mlflow.tracking.MlflowClient(url)
    experiment = client.create_experiment("stack-security")
    assert client.get_experiment(experiment).name == "stack-security"
