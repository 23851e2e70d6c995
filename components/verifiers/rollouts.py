"""The trainer's side of verifiers environments: a batch of rollouts from the worker process
(components/verifiers/worker.py) in verifiers' own environment, with a deadline and a hard kill.

The worker gets the run's secret through its environment ($RLHF_RUN_SECRET), never its command line; the request
goes on its stdin, the answer (JSON, schema in worker.py) comes on its stdout, its log (verifiers' own) goes to
`log_path`. A worker that outlives `timeout_s` is killed with its process group and the batch fails naming the
deadline; one that exits non-zero fails it with its exit code and log tail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Optional

from components.launch.processes import PROJECT_ROOT, project_env
from components.serving.auth import SECRET_ENV

WORKER_MODULE = "components.verifiers.worker"
DEFAULT_PYTHON = ".venv-verifiers/bin/python"


class VerifiersError(RuntimeError):
    """The verifiers worker failed, timed out or answered something else than its schema."""


def verifiers_python(python: str = DEFAULT_PYTHON) -> str:
    path = Path(python)
    path = path if path.is_absolute() else PROJECT_ROOT / path
    if not path.exists():
        raise FileNotFoundError(f"environment.verifiers: {path} does not exist; build verifiers' environment with "
                                f"`make verifiers-venv`")
    return str(path)


def run_rollouts(request: dict, secret: str, log_path: str | Path, timeout_s: float = 600.0,
                 python: str = DEFAULT_PYTHON, env_paths: Optional[list[str]] = None) -> dict:
    """The worker's answer to `request` (worker.py's request schema); `env_paths`: folders where environment modules
    are found (first on its PYTHONPATH)."""
    extra = {SECRET_ENV: secret}
    if env_paths:
        extra["PYTHONPATH"] = os.pathsep.join([*env_paths, str(PROJECT_ROOT)])
    env = project_env(extra)
    env.pop("VIRTUAL_ENV", None)  # the worker's interpreter brings its own environment
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([verifiers_python(python), "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        try:
            out, _ = proc.communicate(json.dumps(request).encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise VerifiersError(f"verifiers worker (pid {proc.pid}, {request.get('env_id')}) did not finish its "
                                 f"batch within {timeout_s:.0f}s: killed; log {log_path}") from None
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise VerifiersError(f"verifiers worker (pid {proc.pid}, {request.get('env_id')}) exited with code "
                             f"{proc.returncode}:\n{tail}")
    try:
        answer = json.loads(out)
    except json.JSONDecodeError as exc:
        raise VerifiersError(f"verifiers worker answered no JSON ({exc}): {out[:300]!r}") from None
    if answer.get("schema") != 1:
        raise VerifiersError(f"verifiers worker answered schema {answer.get('schema')!r}, expected 1")
    return answer
