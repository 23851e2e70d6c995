"""`rlhf up | down | status | demo`: the local stack on 127.0.0.1 (Prefect server, MLflow server, deployment server).

State lives in <state_dir>/stack: pid files, ports, logs. `up` is idempotent and points a Prefect profile
(`rlhf-local`) at the local server, so `prefect deployment run ppo/default` works from a new shell. `down` stops exactly
the processes `up` started. Default ports avoid Triton (8000-8002), MLflow's and moto's default (5000) and each other.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from models.config import default_state_dir

PREFECT_PORT, MLFLOW_PORT = 4200, 5050
PROFILE = "rlhf-local"
SERVICES = ("prefect", "mlflow", "deployments")


def stack_dir(state_dir: Path | None = None) -> Path:
    return (state_dir or default_state_dir()) / "stack"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _pid(state: Path, name: str) -> int | None:
    f = state / f"{name}.pid"
    if not f.exists():
        return None
    pid = int(f.read_text().strip() or 0)
    return pid if pid and _alive(pid) else None


def _ports(state: Path) -> dict:
    f = state / "ports.json"
    return json.loads(f.read_text()) if f.exists() else {}


def running_mlflow_uri(state_dir: Path) -> str | None:
    """The local stack's MLflow URL if `rlhf up` started one that is still alive."""
    state = stack_dir(state_dir)
    return f"http://127.0.0.1:{_ports(state).get('mlflow', MLFLOW_PORT)}" if _pid(state, "mlflow") else None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _port_free(port: int) -> bool:
    from components.launcher import port_block_free

    return port_block_free("127.0.0.1", port, 1)


def _spawn(state: Path, name: str, cmd: list[str], env: dict) -> int:
    log = open(state / "logs" / f"{name}.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    (state / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def _wait(name: str, url: str, pid: int, state: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if _healthy(url):
            return
        if not _alive(pid):
            tail = (state / "logs" / f"{name}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{name} exited during start-up; log tail:\n{tail}")
        time.sleep(0.5)
    raise TimeoutError(f"{name} did not answer {url} within {timeout:.0f}s (log: {state / 'logs' / f'{name}.log'})")


def bin_path(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def base_env(state_dir: Path, prefect_port: int, mlflow_port: int) -> dict:
    env = dict(os.environ)
    env.update({"RLHF_STATE_DIR": str(state_dir), "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
                "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}", "DO_NOT_TRACK": "1",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1",
                # `prefect deployment run --watch` streams a run's logs only when the server publishes them, and
                # stops 3 s after the run's final state: flows ship their logs (a failure's reason) within 0.5 s
                "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true", "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true",
                "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.5"})
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


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
        server_env = dict(env, PREFECT_HOME=str(state_dir / "prefect"))
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
                                       "--workers", "1"], env)
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
    if not _port_free(port):
        raise RuntimeError(f"port {port} on 127.0.0.1 is taken by another process; cannot start {what} there "
                           f"(pass another port to `rlhf up`)")


DEPLOYMENTS = ("ppo/default", "reinforce/default", "critic-server/default", "reward-server/default", "compare/default")


def _wait_deployments(api_url: str, pid: int, state: Path, timeout: float) -> None:
    """Until every deployment of flows/serve.py is registered (they register one after another)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(_healthy(f"{api_url}/deployments/name/{name}") for name in DEPLOYMENTS):
            return
        if not _alive(pid):
            tail = (state / "logs" / "deployments.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the deployment server exited during start-up; log tail:\n{tail}")
        time.sleep(1)
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


def _kill_group(pid: int, grace: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + grace
        while time.time() < deadline:
            if not _alive(pid):
                try:  # reap if it is our child
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
                return
            time.sleep(0.2)


def down(state_dir: Path | None = None, log=print) -> list[str]:
    """Stop what `up` started (deployment server first, so no run is left talking to a dead API)."""
    state = stack_dir((state_dir or default_state_dir()).absolute())
    stopped = []
    for name in ("deployments", "mlflow", "prefect"):
        pid = _pid(state, name)
        if pid:
            _kill_group(pid)
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
    """`make demo`: up, run ppo/default and reinforce/default through Prefect, compare, print where to look."""
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
    log(f"\nDemo finished in {time.time() - started:.0f}s: "
        + ", ".join(f"{d} {'Completed' if rc == 0 else 'FAILED'}" for d, rc in results.items()))
    log(f"  Prefect UI (flow runs, logs, comparison artifact): {urls['prefect']}")
    log(f"  MLflow UI (metrics, params, sample tables, comparison PNG): {urls['mlflow']}")
    log(f"  checkpoints: {state_dir / 'checkpoints'}")
    log("  stop everything with `.venv/bin/rlhf down`")
    return 0 if all(rc == 0 for rc in results.values()) else 1


def last_run_outcome(api_url: str, deployment: str) -> str:
    """'<state>: <message>' of the newest flow run of a deployment (the reason a failed run gives)."""
    import httpx

    flow_name, name = deployment.split("/", 1)
    body = {"flows": {"name": {"any_": [flow_name]}}, "deployments": {"name": {"any_": [name]}},
            "sort": "EXPECTED_START_TIME_DESC", "limit": 1}
    runs = httpx.post(f"{api_url}/flow_runs/filter", json=body, timeout=10).json()
    if not runs:
        return "no flow run found"
    state = runs[0].get("state") or {}
    return f"{state.get('name', '?')}: {state.get('message') or 'no message'}"


def add_stack_parsers(sub) -> None:
    p = sub.add_parser("up", help="start the local stack (Prefect, MLflow, deployments) on 127.0.0.1")
    p.add_argument("--prefect-port", type=int, default=PREFECT_PORT)
    p.add_argument("--mlflow-port", type=int, default=MLFLOW_PORT)
    p.add_argument("--no-profile", action="store_true", help="do not create/activate the rlhf-local Prefect profile")
    p.set_defaults(func=lambda a: bool(up(prefect_port=a.prefect_port, mlflow_port=a.mlflow_port, set_profile=not a.no_profile)) and 0)
    sub.add_parser("down", help="stop what `rlhf up` started").set_defaults(func=lambda a: bool(down()) and 0)
    sub.add_parser("status", help="show the local stack").set_defaults(func=lambda a: bool(status()) and 0)
    sub.add_parser("demo", help="up + run ppo/default and reinforce/default + compare").set_defaults(func=lambda a: demo())
