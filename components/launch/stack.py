"""`rlhf up | down | status | demo`: the local stack on 127.0.0.1 (Prefect server, MLflow server, deployment server).

State lives in <state_dir>/stack: pid files, ports, logs. `up` is idempotent and points a Prefect profile
(`rlhf-local`) at the local server, so `prefect deployment run ppo/default` works from a new shell. `down` stops exactly
the processes `up` started, also from another shell: each is stopped as a process group by the pid in its pid file
(launch/processes.py). Default ports avoid Triton (8000-8002), MLflow's and moto's default (5000) and each other.

Only this machine's own pages may drive the stack (a web page in the user's browser must not start runs with any
config): Prefect's CORS allows its own UI origin only and its CSRF protection is on (every state-changing request
carries a token the Prefect client fetches itself: `prefect deployment run`, the flows, the UI all keep working;
a raw HTTP client takes one through `prefect_post`); MLflow's server accepts its own Host names and CORS origins only
(`--allowed-hosts`, `--cors-allowed-origins`). Both listen on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import httpx
import yaml

from components.launch.processes import PROJECT_ROOT, ChildProcess, alive, port_block_free, project_env, stop_group, wait_for
from models.kinds import KINDS
from models.sections import default_state_dir

PREFECT_PORT, MLFLOW_PORT = 4200, 5050
EXAMPLE_PIPELINE = PROJECT_ROOT / "examples" / "pipeline.yaml"  # what `make demo` runs as pipeline/default
PROFILE = "rlhf-local"
SERVICES = ("prefect", "mlflow", "deployments")


def stack_dir(state_dir: Path | None = None) -> Path:
    return (state_dir or default_state_dir()) / "stack"


def _pid(state: Path, name: str) -> int | None:
    f = state / f"{name}.pid"
    if not f.exists():
        return None
    pid = int(f.read_text().strip() or 0)
    return pid if pid and alive(pid) else None


def _ports(state: Path) -> dict:
    f = state / "ports.json"
    return json.loads(f.read_text()) if f.exists() else {}


def running_mlflow_uri(state_dir: Path) -> str | None:
    """The local stack's MLflow URL if `rlhf up` started one that is still alive."""
    state = stack_dir(state_dir)
    return f"http://127.0.0.1:{_ports(state).get('mlflow', MLFLOW_PORT)}" if _pid(state, "mlflow") else None


def running_prefect_api(state_dir: Path) -> str | None:
    """The local stack's Prefect API URL if `rlhf up` started a Prefect server that is still alive."""
    state = stack_dir(state_dir)
    return f"http://127.0.0.1:{_ports(state).get('prefect', PREFECT_PORT)}/api" if _pid(state, "prefect") else None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _spawn(state: Path, name: str, cmd: list[str], env: dict) -> int:
    """A long-lived service in a session of its own, recorded in <name>.pid for a later `rlhf down`."""
    pid = ChildProcess(cmd, state / "logs" / f"{name}.log", env).pid
    (state / f"{name}.pid").write_text(str(pid))
    return pid


def _started(name: str, ready, pid: int, state: Path, timeout: float, poll_s: float, what: str | None = None,
             tail_chars: int = 2000) -> bool:
    """Wait until `ready()`; fail naming the service (`what`) and its log tail if it exits first. False after
    `timeout`."""
    def check() -> bool:
        if ready():
            return True
        if not alive(pid):
            tail = (state / "logs" / f"{name}.log").read_text(errors="replace")[-tail_chars:]
            raise RuntimeError(f"{what or name} exited during start-up; log tail:\n{tail}")
        return False
    return wait_for(check, timeout, poll_s)


def _wait(name: str, url: str, pid: int, state: Path, timeout: float) -> None:
    if not _started(name, lambda: _healthy(url), pid, state, timeout, poll_s=0.5):
        raise TimeoutError(f"{name} did not answer {url} within {timeout:.0f}s (log: {state / 'logs' / f'{name}.log'})")


def bin_path(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def own_origins(port: int) -> list[str]:
    """The origins of a local service's own UI (the browser's address for it)."""
    return [f"http://127.0.0.1:{port}", f"http://localhost:{port}"]


def prefect_server_env(prefect_port: int) -> dict[str, str]:
    """Prefect server settings of the local stack: CORS limited to its own UI, CSRF protection on."""
    return {"PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": ",".join(own_origins(prefect_port)),
            "PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED": "true",
            "PREFECT_SERVER_API_CORS_ALLOWED_METHODS": "GET,POST,PUT,PATCH,DELETE,OPTIONS"}


def mlflow_security_args(mlflow_port: int) -> list[str]:
    """MLflow server flags of the local stack: its own Host names and CORS origins only."""
    return ["--allowed-hosts", f"127.0.0.1:{mlflow_port},localhost:{mlflow_port},127.0.0.1,localhost",
            "--cors-allowed-origins", ",".join(own_origins(mlflow_port))]


TRANSIENT = (429, 502, 503)  # what Prefect's own client retries (a busy database answers 503): nothing was done


def prefect_post(api_url: str, path: str, body: dict, timeout: float = 10.0, method: str = "POST",
                 retries: int = 5) -> httpx.Response:
    """A POST (or another writing `method`: PATCH, DELETE) to the Prefect API as its own client sends it with CSRF
    protection on. A transient answer (429/502/503) is retried `retries` times, backing off as Prefect's client does
    (Retry-After, else 2^attempt s, at most 10 s); the last answer is returned."""
    answer = _csrf_request(api_url, path, body, timeout, method)
    for attempt in range(retries):
        if answer.status_code not in TRANSIENT:
            break
        wait = answer.headers.get("Retry-After", "")
        time.sleep(min(float(wait) if wait.replace(".", "", 1).isdigit() else 2.0 ** attempt, 10.0))
        answer = _csrf_request(api_url, path, body, timeout, method)
    return answer


def _csrf_request(api_url: str, path: str, body: dict, timeout: float, method: str) -> httpx.Response:
    """A token for a client id of our own first (GET /csrf-token), then the request with both headers; a transient
    answer to the token's request is returned as the answer."""
    client_id = str(uuid.uuid4())
    token = httpx.get(f"{api_url}/csrf-token", params={"client": client_id}, timeout=timeout)
    if token.status_code in TRANSIENT:
        return token
    headers = {}
    if token.status_code == 200:  # a server without CSRF protection answers 422: nothing to send
        headers = {"Prefect-Csrf-Token": token.json()["token"], "Prefect-Csrf-Client": client_id}
    return httpx.request(method, f"{api_url}{path}", json=body, headers=headers, timeout=timeout)


def base_env(state_dir: Path, prefect_port: int, mlflow_port: int) -> dict:
    return project_env({
        "RLHF_STATE_DIR": str(state_dir), "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}", "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
        # MLflow 3's job runners (huey consumers, ~6 per server, ~7% of a core each): nothing here uses MLflow jobs
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        # `prefect deployment run --watch` streams a run's logs only when the server publishes them, and
        # stops 3 s after the run's final state: flows ship their logs (a failure's reason) within 0.5 s
        "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true", "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true",
        "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.5"})


def up(state_dir: Path | None = None, prefect_port: int = PREFECT_PORT, mlflow_port: int = MLFLOW_PORT,
       set_profile: bool = True, timeout: float = 180.0, log=print) -> dict:
    """Start what is not running yet; return the URLs."""
    state_dir = (state_dir or default_state_dir()).absolute()
    state = stack_dir(state_dir)
    (state / "logs").mkdir(parents=True, exist_ok=True)
    ports = _ports(state) if any(_pid(state, s) for s in SERVICES) else {"prefect": prefect_port, "mlflow": mlflow_port}
    (state / "ports.json").write_text(json.dumps(ports))
    env = base_env(state_dir, ports["prefect"], ports["mlflow"])
    urls = {"prefect": f"http://127.0.0.1:{ports['prefect']}", "mlflow": f"http://127.0.0.1:{ports['mlflow']}"}
    started = []
    if _pid(state, "prefect") is None:
        _require_free(ports["prefect"], "Prefect")
        server_env = dict(env, PREFECT_HOME=str(state_dir / "prefect"), **prefect_server_env(ports["prefect"]))
        server_env.pop("PREFECT_API_URL")
        pid = _spawn(state, "prefect", [bin_path("prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                        str(ports["prefect"])], server_env)
        started.append(("prefect", f"{urls['prefect']}/api/health", pid))
    if _pid(state, "mlflow") is None:
        _require_free(ports["mlflow"], "MLflow")
        (state_dir / "mlflow" / "artifacts").mkdir(parents=True, exist_ok=True)
        pid = _spawn(state, "mlflow", [bin_path("mlflow"), "server", "--host", "127.0.0.1", "--port", str(ports["mlflow"]),
                                       "--backend-store-uri", f"sqlite:///{state_dir / 'mlflow' / 'mlflow.db'}",
                                       "--artifacts-destination", str(state_dir / "mlflow" / "artifacts"),
                                       "--workers", "1", *mlflow_security_args(ports["mlflow"])], env)
        started.append(("mlflow", f"{urls['mlflow']}/health", pid))
    for name, url, pid in started:
        _wait(name, url, pid, state, timeout)
        log(f"started {name} (pid {pid}) at {url.rsplit('/', 1)[0] if name == 'mlflow' else urls[name]}")
    if _pid(state, "deployments") is None:
        pid = _spawn(state, "deployments", [sys.executable, "-m", "flows.serve"], env)
        _wait_deployments(env["PREFECT_API_URL"], pid, state, timeout)
        log(f"started the deployment server (pid {pid}): {', '.join(DEPLOYMENTS)}")
    if not started and _pid(state, "deployments"):
        log("the local stack is already running (nothing started)")
    if set_profile:
        _set_profile(env["PREFECT_API_URL"], log)
    log(f"Prefect UI: {urls['prefect']}    MLflow UI: {urls['mlflow']}")
    return urls


def _require_free(port: int, what: str) -> None:
    if not port_block_free("127.0.0.1", port, 1):
        raise RuntimeError(f"port {port} on 127.0.0.1 is taken by another process; cannot start {what} there "
                           f"(pass another port to `rlhf up`)")


DEPLOYMENTS = ("ppo/default", "reinforce/default", "compare/default", "sweep/default", "experiment/default",
               *(f"{kind.command}/default" for kind in KINDS if kind.trains_on_ranks), "pipeline/default")


def _wait_deployments(api_url: str, pid: int, state: Path, timeout: float) -> None:
    """Until every deployment of flows/serve.py is registered (they register one after another)."""
    def registered() -> bool:
        return all(_healthy(f"{api_url}/deployments/name/{name}") for name in DEPLOYMENTS)

    if not _started("deployments", registered, pid, state, timeout, 1.0, "the deployment server", tail_chars=3000):
        raise TimeoutError(f"deployments did not register within {timeout:.0f}s")


def _set_profile(api_url: str, log) -> None:
    """Create/activate the Prefect profile `rlhf-local` in the user's Prefect home, pointing at the local server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    prefect = bin_path("prefect")
    subprocess.run([prefect, "profile", "create", PROFILE], env=env, capture_output=True)  # fails if it exists: fine
    subprocess.run([prefect, "-p", PROFILE, "config", "set", f"PREFECT_API_URL={api_url}",
                    "PREFECT_SERVER_ANALYTICS_ENABLED=false"], env=env, capture_output=True, check=True)
    subprocess.run([prefect, "profile", "use", PROFILE], env=env, capture_output=True, check=True)
    log(f"Prefect profile '{PROFILE}' is active and points at {api_url}: `prefect deployment run ppo/default` "
        f"works from any shell")


def down(state_dir: Path | None = None, log=print) -> list[str]:
    """Stop what `up` started (deployment server first, so no run is left talking to a dead API)."""
    state = stack_dir((state_dir or default_state_dir()).absolute())
    stopped = []
    for name in ("deployments", "mlflow", "prefect"):
        pid = _pid(state, name)
        if pid:
            stop_group(pid)  # it leads its own group: `up` started it in a session of its own
            stopped.append(name)
            log(f"stopped {name} (pid {pid})")
        (state / f"{name}.pid").unlink(missing_ok=True)
    if not stopped:
        log("nothing was running")
    return stopped


def status(state_dir: Path | None = None, log=print) -> dict:
    state = stack_dir((state_dir or default_state_dir()).absolute())
    ports = _ports(state)
    out = {}
    for name in SERVICES:
        pid = _pid(state, name)
        out[name] = {"pid": pid, "running": pid is not None, "port": ports.get(name)}
        log(f"{name:12s} {'running' if pid else 'stopped':8s} pid {pid or '-'}"
            + (f"  http://127.0.0.1:{ports[name]}" if name in ports else ""))
    return out


# ---------------------------------------------------------------------------------------------------------------------
def demo(state_dir: Path | None = None, log=print) -> int:
    """`make demo`: up, run ppo/default and reinforce/default through Prefect, compare, then the whole pipeline of
    examples/pipeline.yaml (pipeline/default), print where to look."""
    state_dir = (state_dir or default_state_dir()).absolute()
    started = time.time()
    urls = up(state_dir, log=log)
    env = base_env(state_dir, _ports(stack_dir(state_dir))["prefect"], _ports(stack_dir(state_dir))["mlflow"])
    results = {}
    for deployment in ("ppo/default", "reinforce/default"):
        log(f"\n$ prefect deployment run {deployment} --watch")
        proc = subprocess.run([bin_path("prefect"), "deployment", "run", deployment, "--watch"], env=env)
        results[deployment] = proc.returncode
        if proc.returncode != 0:
            log(f"{deployment}: {last_run_outcome(env['PREFECT_API_URL'], deployment)}")
    log("\n$ prefect deployment run compare/default --watch")
    subprocess.run([bin_path("prefect"), "deployment", "run", "compare/default", "--watch"], env=env)
    table = state_dir / "compare" / "comparison.md"
    if table.exists():
        log("\n" + "\n".join(line for line in table.read_text().splitlines() if line.startswith("|")))
    if EXAMPLE_PIPELINE.exists():  # sft -> reward model -> RLOO -> eval; a second `make demo` shows every stage Cached
        config = json.dumps(yaml.safe_load(EXAMPLE_PIPELINE.read_text()))
        log(f"\n$ prefect deployment run pipeline/default --param config=<{EXAMPLE_PIPELINE.relative_to(PROJECT_ROOT)}> --watch")
        proc = subprocess.run([bin_path("prefect"), "deployment", "run", "pipeline/default", "--param",
                               f"config={config}", "--watch"], env=env)
        results["pipeline/default"] = proc.returncode
        if proc.returncode != 0:
            log(f"pipeline/default: {last_run_outcome(env['PREFECT_API_URL'], 'pipeline/default')}")
    log(f"\nDemo finished in {time.time() - started:.0f}s: "
        + ", ".join(f"{d} {'Completed' if rc == 0 else 'FAILED'}" for d, rc in results.items()))
    log(f"  Prefect UI (flow runs, logs, comparison artifact): {urls['prefect']}")
    log(f"  MLflow UI (metrics, params, sample tables, comparison PNG): {urls['mlflow']}")
    log(f"  checkpoints: {state_dir / 'checkpoints'}")
    log("  stop everything with `.venv/bin/rlhf down`")
    return 0 if all(rc == 0 for rc in results.values()) else 1


def last_run_outcome(api_url: str, deployment: str) -> str:
    """'<state>: <message>' of the newest flow run of a deployment (the reason a failed run gives)."""
    flow_name, name = deployment.split("/", 1)
    body = {"flows": {"name": {"any_": [flow_name]}}, "deployments": {"name": {"any_": [name]}},
            "sort": "EXPECTED_START_TIME_DESC", "limit": 1}
    runs = prefect_post(api_url, "/flow_runs/filter", body).json()
    if not runs:
        return "no flow run found"
    state = runs[0].get("state") or {}
    return f"{state.get('name', '?')}: {state.get('message') or 'no message'}"
