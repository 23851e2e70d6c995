"""`rlhf up | down | status | demo`: the local stack on 127.0.0.1 (Prefect server, MLflow server, deployment server).

State lives in <state_dir>/stack: pid files, ports, logs. `up` is idempotent and points a Prefect profile
(`rlhf-local`) at the local server, so `prefect deployment run ppo/default` works from a new shell. `down` stops exactly
the processes `up` started, also from another shell: each is stopped as a process group by the pid in its pid file
(launch/processes.py). Default ports avoid Triton (8000-8002), MLflow's and moto's default (5000) and each other.

Only the stack's owner may drive it: any local user reaches 127.0.0.1, and a run's reward file runs as the stack's
owner. So Prefect's API and MLflow's server need credentials, which `up` makes once (random, `credentials`) and keeps in
<state_dir>/stack/credentials.json, mode 0600: Prefect's basic auth (PREFECT_SERVER_API_AUTH_STRING on the server,
PREFECT_API_AUTH_STRING for its clients) and MLflow's basic-auth app (`--app-name basic-auth`, its admin user; clients
send MLFLOW_TRACKING_USERNAME/PASSWORD). They reach processes through their environment only (`base_env`, the
`rlhf-local` Prefect profile, made 0600 too), never a command line or a log. The UIs ask for them: Prefect's login form
takes the `prefect` entry (user:password), MLflow's browser dialog the `mlflow_user` and `mlflow_password` entries.
Liveness (`/api/health`, `/health`) answers without.

Nor may a web page in the user's browser drive it: Prefect's CORS allows its own UI origin only and its CSRF protection
is on (every state-changing request carries a token the Prefect client fetches itself: `prefect deployment run`, the
flows, the UI all keep working; a raw HTTP client takes one through `prefect_post`); MLflow's server accepts its own
Host names and CORS origins only (`--allowed-hosts`, `--cors-allowed-origins`). Both listen on 127.0.0.1 only.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import httpx
import yaml

from components.launch.flow_runs import SWITCH as FORK_SWITCH
from components.launch.processes import (PROJECT_ROOT, ChildProcess, alive, port_block_free, project_env, stop_group,
                                         wait_for)
from models.kinds import KINDS
from models.sections import default_state_dir

PREFECT_PORT, MLFLOW_PORT = 4200, 5050
EXAMPLE_PIPELINE = PROJECT_ROOT / "examples" / "pipeline.yaml"  # what `make demo` runs as pipeline/default
PROFILE = "rlhf-local"
CREDENTIALS = "credentials.json"  # in <state_dir>/stack, mode 0600
MLFLOW_USER = "rlhf"
LOG = logging.getLogger("rlhf.stack")
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


def credentials(state: Path, create: bool = False) -> dict | None:
    """The local stack's credentials (<state>/credentials.json, mode 0600): made at random by the first `up`
    (`create`), the same ever after; None when there are none yet. A file others could read is made 0600 again."""
    path = state / CREDENTIALS
    if path.exists():
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            LOG.warning("%s could be read by other users: made 0600 (if they did, delete it with the stack down, "
                        "and `rlhf up` makes new credentials)", path)
            path.chmod(0o600)
        return json.loads(path.read_text())
    if not create:
        return None
    made = {"prefect": f"rlhf:{secrets.token_urlsafe(24)}", "mlflow_user": MLFLOW_USER,
            "mlflow_password": secrets.token_urlsafe(24), "mlflow_flask_key": secrets.token_urlsafe(32)}
    state.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, not once
    with os.fdopen(descriptor, "w") as f:
        json.dump(made, f)
    mlflow_auth_db(state.parent).unlink(missing_ok=True)  # its admin user was made with other credentials
    return made


def client_env(creds: dict | None) -> dict[str, str]:
    """What Prefect's and MLflow's clients read the stack's credentials from (a process's environment)."""
    if not creds:
        return {}
    return {"PREFECT_API_AUTH_STRING": creds["prefect"], "MLFLOW_TRACKING_USERNAME": creds["mlflow_user"],
            "MLFLOW_TRACKING_PASSWORD": creds["mlflow_password"]}


def basic_auth(user_password: str | None) -> dict[str, str]:
    """The `Authorization: Basic` header of `user:password` ({} without)."""
    return {"Authorization": f"Basic {base64.b64encode(user_password.encode()).decode()}"} if user_password else {}


def running_mlflow_uri(state_dir: Path) -> str | None:
    """The local stack's MLflow URL if `rlhf up` started one that is still alive; its credentials then go into this
    process's environment, where MLflow's client reads them."""
    state = stack_dir(state_dir)
    if not _pid(state, "mlflow"):
        return None
    os.environ.update({k: v for k, v in client_env(credentials(state)).items() if k.startswith("MLFLOW_")})
    return f"http://127.0.0.1:{_ports(state).get('mlflow', MLFLOW_PORT)}"


def running_prefect_api(state_dir: Path) -> str | None:
    """The local stack's Prefect API URL if `rlhf up` started a Prefect server that is still alive."""
    state = stack_dir(state_dir)
    return f"http://127.0.0.1:{_ports(state).get('prefect', PREFECT_PORT)}/api" if _pid(state, "prefect") else None


def prefect_env(state_dir: Path) -> dict[str, str]:
    """The environment that points a Prefect client at the local stack: its API URL and credentials ({} when no
    stack runs)."""
    api = running_prefect_api(state_dir)
    if api is None:
        return {}
    return {"PREFECT_API_URL": api, **{k: v for k, v in client_env(credentials(stack_dir(state_dir))).items()
                                       if k.startswith("PREFECT_")}}


def _healthy(url: str, auth: str | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=basic_auth(auth)), timeout=2) as r:
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


def prefect_server_env(prefect_port: int, creds: dict) -> dict[str, str]:
    """Prefect server settings of the local stack: its credentials, CORS limited to its own UI, CSRF protection on."""
    return {"PREFECT_SERVER_API_AUTH_STRING": creds["prefect"],
            "PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": ",".join(own_origins(prefect_port)),
            "PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED": "true",
            "PREFECT_SERVER_API_CORS_ALLOWED_METHODS": "GET,POST,PUT,PATCH,DELETE,OPTIONS"}


def mlflow_security_args(mlflow_port: int) -> list[str]:
    """MLflow server flags of the local stack: its basic-auth app, its own Host names and CORS origins only."""
    return ["--app-name", "basic-auth",
            "--allowed-hosts", f"127.0.0.1:{mlflow_port},localhost:{mlflow_port},127.0.0.1,localhost",
            "--cors-allowed-origins", ",".join(own_origins(mlflow_port))]


def mlflow_auth_db(state_dir: Path) -> Path:
    return state_dir / "mlflow" / "auth.db"


def mlflow_server_env(state_dir: Path, creds: dict) -> dict[str, str]:
    """MLflow server settings of the local stack: its basic-auth app's config (a file without the password, 0600),
    admin user and password (read when it first makes its user store), and the key of its CSRF protection."""
    (state_dir / "mlflow").mkdir(parents=True, exist_ok=True)
    config = state_dir / "mlflow" / "auth.ini"
    descriptor = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as f:
        # the admin is the only user; a password check per request costs a PBKDF2: checked ones are kept 5 minutes
        f.write(f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{mlflow_auth_db(state_dir)}\n"
                f"admin_username = {creds['mlflow_user']}\nauth_cache_ttl_seconds = 300\n")
    return {"MLFLOW_AUTH_CONFIG_PATH": str(config), "MLFLOW_AUTH_ADMIN_USERNAME": creds["mlflow_user"],
            "MLFLOW_AUTH_ADMIN_PASSWORD": creds["mlflow_password"],
            "MLFLOW_FLASK_SERVER_SECRET_KEY": creds["mlflow_flask_key"]}


TRANSIENT = (429, 502, 503)  # what Prefect's own client retries (a busy database answers 503): nothing was done


def prefect_auth() -> str | None:
    """The Prefect credentials of this process (PREFECT_API_AUTH_STRING in its environment)."""
    return os.environ.get("PREFECT_API_AUTH_STRING") or None


def prefect_get(api_url: str, path: str, timeout: float = 10.0, auth: str | None = None) -> httpx.Response:
    """A GET of the Prefect API with `auth` (user:password; None: this process's credentials)."""
    return httpx.get(f"{api_url}{path}", headers=basic_auth(auth or prefect_auth()), timeout=timeout)


def prefect_post(api_url: str, path: str, body: dict, timeout: float = 10.0, method: str = "POST",
                 retries: int = 5, auth: str | None = None) -> httpx.Response:
    """A POST (or another writing `method`: PATCH, DELETE) to the Prefect API as its own client sends it with CSRF
    protection on, with `auth` (user:password; None: this process's credentials, `prefect_auth`). A transient answer
    (429/502/503) is retried `retries` times, backing off as Prefect's client does (Retry-After, else 2^attempt s, at
    most 10 s); the last answer is returned."""
    auth = auth or prefect_auth()
    answer = _csrf_request(api_url, path, body, timeout, method, auth)
    for attempt in range(retries):
        if answer.status_code not in TRANSIENT:
            break
        wait = answer.headers.get("Retry-After", "")
        time.sleep(min(float(wait) if wait.replace(".", "", 1).isdigit() else 2.0 ** attempt, 10.0))
        answer = _csrf_request(api_url, path, body, timeout, method, auth)
    return answer


def _csrf_request(api_url: str, path: str, body: dict, timeout: float, method: str,
                  user_password: str | None) -> httpx.Response:
    """A token for a client id of our own first (GET /csrf-token), then the request with both headers; a transient
    answer to the token's request is returned as the answer."""
    client_id = str(uuid.uuid4())
    auth = basic_auth(user_password)
    token = httpx.get(f"{api_url}/csrf-token", params={"client": client_id}, headers=auth, timeout=timeout)
    if token.status_code in TRANSIENT:
        return token
    headers = dict(auth)
    if token.status_code == 200:  # a server without CSRF protection answers 422: nothing to send
        headers.update({"Prefect-Csrf-Token": token.json()["token"], "Prefect-Csrf-Client": client_id})
    return httpx.request(method, f"{api_url}{path}", json=body, headers=headers, timeout=timeout)


def base_env(state_dir: Path, prefect_port: int, mlflow_port: int) -> dict:
    """The environment of the stack's processes and of what runs on it: its URLs, and its credentials once `up`
    has made them."""
    return project_env({**client_env(credentials(stack_dir(state_dir))),
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
    creds = credentials(state, create=True)
    env = base_env(state_dir, ports["prefect"], ports["mlflow"])
    urls = {"prefect": f"http://127.0.0.1:{ports['prefect']}", "mlflow": f"http://127.0.0.1:{ports['mlflow']}"}
    started = []
    if _pid(state, "prefect") is None:
        _require_free(ports["prefect"], "Prefect")
        server_env = dict(env, PREFECT_HOME=str(state_dir / "prefect"), **prefect_server_env(ports["prefect"], creds))
        server_env.pop("PREFECT_API_URL")
        pid = _spawn(state, "prefect", [bin_path("prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                        str(ports["prefect"])], server_env)
        started.append(("prefect", f"{urls['prefect']}/api/health", pid))
    if _pid(state, "mlflow") is None:
        _require_free(ports["mlflow"], "MLflow")
        (state_dir / "mlflow" / "artifacts").mkdir(parents=True, exist_ok=True)
        pid = _spawn(state, "mlflow",
                     [bin_path("mlflow"), "server", "--host", "127.0.0.1", "--port", str(ports["mlflow"]),
                                       "--backend-store-uri", f"sqlite:///{state_dir / 'mlflow' / 'mlflow.db'}",
                                       "--artifacts-destination", str(state_dir / "mlflow" / "artifacts"),
                                       "--workers", "1", *mlflow_security_args(ports["mlflow"])],
                     {**env, **mlflow_server_env(state_dir, creds)})
        started.append(("mlflow", f"{urls['mlflow']}/health", pid))
    for name, url, pid in started:
        _wait(name, url, pid, state, timeout)
        log(f"started {name} (pid {pid}) at {url.rsplit('/', 1)[0] if name == 'mlflow' else urls[name]}")
    if _pid(state, "deployments") is None:
        # its flow runs start as forks of a process that has imported the flows (components/launch/flow_runs.py),
        # unless the caller's environment says RLHF_FORK_FLOW_RUNS=0
        pid = _spawn(state, "deployments", [sys.executable, "-m", "flows.serve"],
                     {**env, FORK_SWITCH: env.get(FORK_SWITCH, "1")})
        _wait_deployments(env["PREFECT_API_URL"], creds["prefect"], pid, state, timeout)
        log(f"started the deployment server (pid {pid}): {', '.join(DEPLOYMENTS)}")
    if not started and _pid(state, "deployments"):
        log("the local stack is already running (nothing started)")
    if set_profile:
        _set_profile(env["PREFECT_API_URL"], creds["prefect"], log)
    log(f"Prefect UI: {urls['prefect']}    MLflow UI: {urls['mlflow']}    (their logins: {state / CREDENTIALS})")
    return urls


def _require_free(port: int, what: str) -> None:
    if not port_block_free("127.0.0.1", port, 1):
        raise RuntimeError(f"port {port} on 127.0.0.1 is taken by another process; cannot start {what} there "
                           f"(pass another port to `rlhf up`)")


DEPLOYMENTS = ("ppo/default", "reinforce/default", "compare/default", "sweep/default", "experiment/default",
               *(f"{kind.command}/default" for kind in KINDS if kind.trains_on_ranks), "pipeline/default")


def _wait_deployments(api_url: str, auth: str, pid: int, state: Path, timeout: float) -> None:
    """Until every deployment of flows/serve.py is registered (they register one after another)."""
    def registered() -> bool:
        return all(_healthy(f"{api_url}/deployments/name/{name}", auth) for name in DEPLOYMENTS)

    if not _started("deployments", registered, pid, state, timeout, 1.0, "the deployment server", tail_chars=3000):
        raise TimeoutError(f"deployments did not register within {timeout:.0f}s")


def _set_profile(api_url: str, auth: str, log) -> None:
    """Create/activate the Prefect profile `rlhf-local` in the user's Prefect home, pointing at the local server with
    its credentials (written by Prefect's own profile code, never through a command line; the file made 0600)."""
    from prefect.settings import (PREFECT_API_AUTH_STRING, PREFECT_API_URL, PREFECT_PROFILES_PATH,  # heavy: up only
                                  PREFECT_SERVER_ANALYTICS_ENABLED, load_profiles, save_profiles)

    path = Path(PREFECT_PROFILES_PATH.value())
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))  # 0600 before the credentials are written into it
    path.chmod(0o600)
    profiles = load_profiles(include_defaults=False)
    profiles.update_profile(PROFILE, {PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth,
                                      PREFECT_SERVER_ANALYTICS_ENABLED: False})
    profiles.set_active(PROFILE)
    save_profiles(profiles)
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
    creds = env["PREFECT_API_AUTH_STRING"]
    results = {}
    for deployment in ("ppo/default", "reinforce/default"):
        log(f"\n$ prefect deployment run {deployment} --watch")
        proc = subprocess.run([bin_path("prefect"), "deployment", "run", deployment, "--watch"], env=env)
        results[deployment] = proc.returncode
        if proc.returncode != 0:
            log(f"{deployment}: {last_run_outcome(env['PREFECT_API_URL'], deployment, creds)}")
    log("\n$ prefect deployment run compare/default --watch")
    subprocess.run([bin_path("prefect"), "deployment", "run", "compare/default", "--watch"], env=env)
    table = state_dir / "compare" / "comparison.md"
    if table.exists():
        log("\n" + "\n".join(line for line in table.read_text().splitlines() if line.startswith("|")))
    if EXAMPLE_PIPELINE.exists():  # sft -> reward model -> RLOO -> eval; a second `make demo` shows every stage Cached
        config = json.dumps(yaml.safe_load(EXAMPLE_PIPELINE.read_text()))
        log("\n$ prefect deployment run pipeline/default --param "
            f"config=<{EXAMPLE_PIPELINE.relative_to(PROJECT_ROOT)}> --watch")
        proc = subprocess.run([bin_path("prefect"), "deployment", "run", "pipeline/default", "--param",
                               f"config={config}", "--watch"], env=env)
        results["pipeline/default"] = proc.returncode
        if proc.returncode != 0:
            log(f"pipeline/default: {last_run_outcome(env['PREFECT_API_URL'], 'pipeline/default', creds)}")
    log(f"\nDemo finished in {time.time() - started:.0f}s: "
        + ", ".join(f"{d} {'Completed' if rc == 0 else 'FAILED'}" for d, rc in results.items()))
    log(f"  Prefect UI (flow runs, logs, comparison artifact): {urls['prefect']}")
    log(f"  MLflow UI (metrics, params, sample tables, comparison PNG): {urls['mlflow']}")
    log(f"  checkpoints: {state_dir / 'checkpoints'}")
    log("  stop everything with `.venv/bin/rlhf down`")
    return 0 if all(rc == 0 for rc in results.values()) else 1


def last_run_outcome(api_url: str, deployment: str, auth: str | None = None) -> str:
    """'<state>: <message>' of the newest flow run of a deployment (the reason a failed run gives)."""
    flow_name, name = deployment.split("/", 1)
    body = {"flows": {"name": {"any_": [flow_name]}}, "deployments": {"name": {"any_": [name]}},
            "sort": "EXPECTED_START_TIME_DESC", "limit": 1}
    runs = prefect_post(api_url, "/flow_runs/filter", body, auth=auth).json()
    if not runs:
        return "no flow run found"
    state = runs[0].get("state") or {}
    return f"{state.get('name', '?')}: {state.get('message') or 'no message'}"
