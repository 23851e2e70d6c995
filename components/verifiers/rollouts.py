"""The trainer's side of verifiers environments: a batch of rollouts from the worker process
(components/verifiers/worker.py) in verifiers' own environment, with a deadline and a hard kill.

The worker gets the run's secret through its environment ($RLHF_RUN_SECRET), never its command line; the request
goes on its stdin, the answer (JSON, schema in worker.py) comes on its stdout, its log (verifiers' own) goes to
`log_path`. A worker that outlives `timeout_s` is killed with its process group and the batch fails naming the
deadline; one that exits non-zero fails it with its exit code and log tail.

A verifiers run (environment.verifiers) reads its prompts from the environment's dataset (`prompt_set`) and plays
its episodes through `rollout_source` (models/environments/remote.py turns the records into episodes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Optional

from components.launch.processes import PROJECT_ROOT, project_env
from components.verifiers.worker import SECRET_ENV
from models.data import PromptSet
from models.policy import load_policy_tokenizer

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


def run_rollouts(request: dict, secret: Optional[str], log_path: str | Path, timeout_s: float = 600.0,
                 python: str = DEFAULT_PYTHON, env_paths: Optional[list[str]] = None) -> dict:
    """The worker's answer to `request` (worker.py's request schema); `env_paths`: folders where environment modules
    are found (first on its PYTHONPATH). `secret`: the run's (None for a dataset request: no server is asked)."""
    extra = {SECRET_ENV: secret} if secret else {}
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


# ------------------------------------------------------------------------------------------------ a verifiers run
def prompt_set(cfg, split: str, limit: Optional[int] = None):
    """The environment's rows of `split` ("train": get_dataset, "eval": get_eval_dataset; the first `limit`) as the
    run's prompts (models/data.PromptSet): the messages rendered with the policy's chat template, each row's position
    and split as its columns (what a rollout request names)."""
    v = cfg.environment.verifiers
    log = Path(cfg.deploy.state_dir) / "verifiers" / f"{v.id}-dataset.log"
    rows = run_rollouts({"mode": "dataset", "env_id": v.id, "env_args": v.args, "split": split}, None, log,
                        v.timeout_s, env_paths=v.paths)["rows"][:limit]
    if not rows:
        raise ValueError(f"environment.verifiers: {v.id}'s {split} dataset has no rows")
    tokenizer = load_policy_tokenizer(cfg.resolve_model_path(cfg.model.policy))
    prompts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True) for row in rows]
    return PromptSet(prompts, [{"example_id": row["example_id"], "split": split} for row in rows],
                     f"verifiers:{v.id}/{split}", templated=True, raw=[row["prompt"] for row in rows])


def rollout_source(v, base_url: str, secret: str, log_path: str | Path):
    """What a verifiers run's episodes are played with on rank 0 (models/environments/remote.py's `Source`): rows
    (k consecutive ones per prompt) to one rollout record each, by verifiers' own code in the worker, a group of k
    rollouts per prompt."""

    def play(rows: list[dict], sampling: dict) -> list[dict]:
        groups: list[list[dict]] = []
        for row in rows:
            if groups and (groups[-1][0]["split"], groups[-1][0]["example_id"]) == (row["split"], row["example_id"]):
                groups[-1].append(row)
            else:
                groups.append([row])
        sizes, splits = {len(g) for g in groups}, {g[0]["split"] for g in groups}
        if len(sizes) != 1 or len(splits) != 1:
            raise ValueError(f"environment.verifiers: a batch must be k rollouts of each prompt of one split, got "
                             f"groups of {sorted(sizes)} from {sorted(splits)}")
        answer = run_rollouts({"env_id": v.id, "env_args": v.args, "base_url": base_url, "client_type": v.client_type,
                               "sampling_args": sampling, "split": splits.pop(),
                               "example_ids": [g[0]["example_id"] for g in groups],
                               "rollouts_per_example": sizes.pop(), "max_concurrent": v.max_concurrent,
                               "timeout_s": v.timeout_s}, secret, log_path, v.timeout_s, env_paths=v.paths)
        return answer["rollouts"]

    return play
