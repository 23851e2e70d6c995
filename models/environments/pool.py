"""The environment workers of one actor rank (models/environments/worker.py), with deadlines and a hard kill.

`WorkerPool(n, factories, rewards)` starts n worker processes, each loading the environment classes and the reward
functions. `run(requests)` sends each request to its worker (the requests of one worker in order, the workers in
parallel) and waits for each answer no longer than its deadline: a worker that does not answer in time is killed
(SIGKILL: a hung tool, a reward that never returns, a C extension that ignores signals) and replaced by a fresh one,
and so is a worker that died. Such a request is answered `timeout` or `error`; a later request for an instance the
killed worker held is answered `lost` (its state went with it). The pool goes on: what failed is its caller's to
count. `close()` kills every worker; a worker also exits by itself when this process is gone.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from models.environments.worker import PARENT_PID_ENV

PROJECT_ROOT = Path(__file__).resolve().parents[2]
START_DEADLINE_S = 120.0  # for a worker to import the environments and reward functions


class EnvironmentLoadError(RuntimeError):
    """The environments of a run cannot be used at all (a worker cannot load them); the message names why."""


@dataclass
class Request:
    worker: int
    payload: dict  # {"op": ..., ...}
    deadline_s: float
    key: str | None = None  # the instance it needs (None: none, or a reset, which makes it)


@dataclass
class Answer:
    status: str  # ok | error | timeout | lost
    result: object = None
    error: str = ""
    seconds: float = 0.0


class Channel:
    """One worker process and its two pipes."""

    def __init__(self, index: int):
        self.index = index
        to_worker_r, self.to_worker = os.pipe()
        self.from_worker, from_worker_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT)]
                                            + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env[PARENT_PID_ENV] = str(os.getpid())
        # a process group of its own, so a kill takes what its tools started too (it still exits with this process)
        self.process = subprocess.Popen([sys.executable, "-m", "models.environments.worker", str(to_worker_r),
                                         str(from_worker_w)], pass_fds=(to_worker_r, from_worker_w), env=env,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        os.close(to_worker_r)
        os.close(from_worker_w)
        self.buffer = b""
        self.closed = False  # the worker closed its pipe: it died (or is dying)

    def send(self, payload: dict) -> None:
        data = json.dumps(payload, default=str).encode() + b"\n"
        view = memoryview(data)
        while view:
            view = view[os.write(self.to_worker, view):]

    def receive(self, deadline_s: float) -> dict | None:
        """The next answer, or None when none came within `deadline_s` (or the worker closed its pipe: died)."""
        end = time.monotonic() + deadline_s
        while b"\n" not in self.buffer:
            left = end - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.from_worker], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.from_worker, 1 << 16)
            if not chunk:
                self.closed = True
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def died(self) -> bool:
        """Whether the worker died (rather than not answering in time). Its pipe closes while it exits, before the
        process can be reaped: a closed pipe waits briefly for the exit code."""
        if self.closed:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            return True
        return self.process.poll() is not None

    def exit_description(self) -> str:
        code = self.process.poll()
        return f"environment worker {self.index} (pid {self.process.pid}) " + (
            f"exited with code {code}" if code is not None else "did not answer")

    def kill(self) -> None:
        """SIGKILL to the worker's whole process group: the worker and every process its tools started."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone already
            pass
        self.process.wait()
        for fd in (self.to_worker, self.from_worker):
            try:
                os.close(fd)
            except OSError:
                pass


@dataclass
class WorkerPool:
    size: int
    factories: dict  # {name ("" for the single one): spec}
    rewards: list[str]
    channels: list[Channel] = field(default_factory=list)
    alive_keys: list[set] = field(default_factory=list)  # instance keys each worker holds
    conventions: list[dict] = field(default_factory=list)  # each reward function's (from the first worker)
    restarts: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> "WorkerPool":
        self.channels = [Channel(i) for i in range(self.size)]
        self.alive_keys = [set() for _ in range(self.size)]
        for channel in self.channels:  # every worker loads at once
            channel.send(self._load_request())
        for i in range(self.size):
            self._loaded(i)
        return self

    def _load_request(self) -> dict:
        return {"op": "load", "factories": self.factories, "rewards": self.rewards}

    def _load(self, i: int) -> None:
        self.channels[i].send(self._load_request())
        self._loaded(i)

    def _loaded(self, i: int) -> None:
        channel = self.channels[i]
        answer = channel.receive(START_DEADLINE_S)
        if answer is None:
            description = channel.exit_description()
            self.close()
            raise EnvironmentLoadError(f"{description} while loading the environments and reward functions "
                                    f"(within {START_DEADLINE_S:g} s)")
        if not answer["ok"]:
            self.close()
            raise EnvironmentLoadError(answer["error"])
        self.conventions = answer["result"]["rewards"]

    def probe(self, deadline_s: float) -> dict:
        """Each environment's tools, reward and session declaration (worker 0 builds one instance of each)."""
        answer = self.run([Request(0, {"op": "probe"}, max(deadline_s, START_DEADLINE_S))])[0]
        if answer.status != "ok":
            raise EnvironmentLoadError(f"probing the environments: {answer.error}")
        return answer.result

    def holds(self, worker: int, key: str) -> bool:
        """Whether `worker` still holds the instance `key` (it was reset there and the worker was not replaced)."""
        return key in self.alive_keys[worker]

    def restart(self, i: int) -> None:
        """Kill worker i and start a fresh one in its place (its instances are gone)."""
        self.channels[i].kill()
        self.channels[i] = Channel(i)
        self.alive_keys[i] = set()
        with self._lock:
            self.restarts += 1
        self._load(i)

    def _serve(self, i: int, requests: list[tuple[int, Request]]) -> list[tuple[int, Answer]]:
        out = []
        for position, request in requests:
            if request.key is not None and request.payload["op"] != "reset" and request.key not in self.alive_keys[i]:
                out.append((position, Answer("lost", error="its environment instance was lost: its worker was "
                                                           "killed or died during another call")))
                continue
            channel = self.channels[i]
            started = time.monotonic()
            channel.send(request.payload)
            answer = channel.receive(request.deadline_s)
            seconds = time.monotonic() - started
            if answer is None:
                dead = channel.died()
                description = channel.exit_description()
                self.restart(i)
                if dead:
                    out.append((position, Answer("error", error=f"{description} during {request.payload['op']}",
                                                 seconds=seconds)))
                else:
                    out.append((position, Answer("timeout", error=f"{request.payload['op']} did not return within "
                                                                  f"{request.deadline_s:.3g} s: environment worker "
                                                                  f"{i} killed and replaced", seconds=seconds)))
                continue
            if request.payload["op"] == "reset" and request.key is not None and answer["ok"]:
                self.alive_keys[i].add(request.key)
            out.append((position, Answer("ok", answer["result"], seconds=seconds) if answer["ok"]
                        else Answer("error", error=answer["error"], seconds=seconds)))
        return out

    def run(self, requests: list[Request]) -> list[Answer]:
        """Every request answered, in the order given (each worker's in order, the workers in parallel)."""
        by_worker: dict[int, list[tuple[int, Request]]] = {}
        for position, request in enumerate(requests):
            by_worker.setdefault(request.worker, []).append((position, request))
        answers: list[Answer | None] = [None] * len(requests)
        if len(by_worker) <= 1:
            results = [self._serve(i, items) for i, items in by_worker.items()]
        else:
            with ThreadPoolExecutor(len(by_worker), thread_name_prefix="env-worker") as threads:
                results = list(threads.map(lambda item: self._serve(*item), by_worker.items()))
        for part in results:
            for position, answer in part:
                answers[position] = answer
        return answers

    def close(self) -> None:
        for channel in self.channels:
            channel.kill()
        self.channels = []
