"""The trainer's side of verifiers environments: a batch of rollouts from the worker process
(components/verifiers/worker.py) in verifiers' own environment, with a deadline and a hard kill.

The worker gets the run's secret through its environment ($RLHF_RUN_SECRET), never its command line; each request
goes on its stdin as a line, each answer (JSON, schema in worker.py) comes on its stdout as a line, its log
(verifiers' own) goes to `log_path`. One worker plays a run's batches (`VerifiersWorker`: verifiers and the
environment load once). A batch that outlives its deadline kills the worker with its process group and fails naming
the deadline; a worker that exits fails it with its exit code and log tail.

A verifiers run (environment.verifiers) reads its prompts from the environment's datasets (`prompt_sets`) and plays
its episodes through `rollout_source` (models/environments/remote.py turns the records into episodes).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
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


class VerifiersWorker:
    """A worker process (worker.py) that plays a run's batches one after another: verifiers and the environment load
    once, not once a batch. Each request is one JSON line on its stdin, its answer one line on its stdout. A batch
    past its deadline kills the worker (its process group) and fails naming the deadline; a worker that exits fails
    the batch with its exit code and log tail; either way the next request starts a new worker. `close()` ends it.
    `secret`: the run's (None for dataset requests: no server is asked); `env_paths`: folders where environment
    modules are found (first on its PYTHONPATH)."""

    def __init__(self, secret: Optional[str], log_path: str | Path, python: str = DEFAULT_PYTHON,
                 env_paths: Optional[list[str]] = None):
        extra = {SECRET_ENV: secret} if secret else {}
        if env_paths:
            extra["PYTHONPATH"] = os.pathsep.join([*env_paths, str(PROJECT_ROOT)])
        self.env = project_env(extra)
        self.env.pop("VIRTUAL_ENV", None)  # the worker's interpreter brings its own environment
        self.python, self.log_path = verifiers_python(python), Path(log_path)
        self.proc: Optional[subprocess.Popen] = None
        self.answers: queue.Queue = queue.Queue()

    def _start(self) -> subprocess.Popen:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen([self.python, "-m", WORKER_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=log, env=self.env, start_new_session=True)
        answers = self.answers = queue.Queue()

        def read() -> None:  # every answer line, then None at the end of its stdout
            for line in proc.stdout:
                answers.put(line)
            answers.put(None)

        threading.Thread(target=read, name=f"verifiers-worker-{proc.pid}", daemon=True).start()
        return proc

    def request(self, request: dict, timeout_s: float = 600.0) -> dict:
        """The worker's answer to `request` (worker.py's request schema), within `timeout_s`."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        proc, what = self.proc, request.get("env_id")
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
            line = self.answers.get(timeout=timeout_s)
        except queue.Empty:
            self._kill()
            raise VerifiersError(f"verifiers worker (pid {proc.pid}, {what}) did not finish its batch within "
                                 f"{timeout_s:.0f}s: killed; log {self.log_path}") from None
        except BrokenPipeError:
            line = None
        except BaseException:
            self._kill()
            raise
        if line is None:
            code = proc.wait()
            self.proc = None
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise VerifiersError(f"verifiers worker (pid {proc.pid}, {what}) exited with code {code}:\n{tail}")
        try:
            answer = json.loads(line)
        except json.JSONDecodeError as exc:
            self._kill()
            raise VerifiersError(f"verifiers worker answered no JSON ({exc}): {line[:300]!r}") from None
        if answer.get("schema") != 1:
            raise VerifiersError(f"verifiers worker answered schema {answer.get('schema')!r}, expected 1")
        return answer

    def _kill(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        """End the worker: its stdin closed (it exits), killed if it has not within 10 s."""
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
                self.proc = None
            except (OSError, subprocess.TimeoutExpired):
                self._kill()

    def __enter__(self) -> "VerifiersWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------ a verifiers run
def prompt_sets(cfg, eval_limit: Optional[int] = None, evals: bool = True) -> tuple:
    """The environment's rows as the run's prompts (models/data.PromptSet), read by one worker: its train rows
    (get_dataset) and, with `evals`, its first `eval_limit` eval rows (get_eval_dataset; else None). The messages are
    rendered with the policy's chat template; each row's position and split are its columns (what a rollout request
    names)."""
    v = cfg.environment.verifiers
    tokenizer = load_policy_tokenizer(cfg.local_path("model.policy"))
    sets = []
    with VerifiersWorker(None, Path(cfg.deploy.state_dir) / "verifiers" / f"{v.id}-dataset.log",
                         env_paths=v.paths) as worker:
        for split, limit in (("train", None), ("eval", eval_limit))[:2 if evals else 1]:
            rows = worker.request({"mode": "dataset", "env_id": v.id, "env_args": v.args, "split": split},
                                  v.timeout_s)["rows"][:limit]
            if not rows:
                raise ValueError(f"environment.verifiers: {v.id}'s {split} dataset has no rows")
            prompts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
                       for row in rows]
            sets.append(PromptSet(prompts, [{"example_id": row["example_id"], "split": split} for row in rows],
                                  f"verifiers:{v.id}/{split}", templated=True, raw=[row["prompt"] for row in rows]))
    return sets[0], (sets[1] if evals else None)


def rollout_source(v, base_url: str, worker: VerifiersWorker):
    """What a verifiers run's episodes are played with on rank 0 (models/environments/remote.py's `Source`): rows
    (k consecutive ones per prompt) to one rollout record each, by verifiers' own code in the run's `worker`, a group
    of k rollouts per prompt."""

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
        answer = worker.request({"env_id": v.id, "env_args": v.args, "base_url": base_url,
                                 "client_type": v.client_type, "sampling_args": sampling, "split": splits.pop(),
                                 "example_ids": [g[0]["example_id"] for g in groups],
                                 "rollouts_per_example": sizes.pop(), "max_concurrent": v.max_concurrent,
                                 "timeout_s": v.timeout_s}, v.timeout_s)
        return answer["rollouts"]

    return play
