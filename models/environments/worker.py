"""An environment worker process: `python -m models.environments.worker READ_FD WRITE_FD`.

It holds environment instances (TRL's `environment_factory` protocol) and the run's reward functions, and executes
one request at a time in its main thread (so a reward that times itself out with `signal.alarm`, as math_verify
does, works), answering each on its own pipe: one JSON object a line each way. What the trainer's side
(models/environments/pool.py) asks:

    load     {factories: {name: spec}, rewards: [spec]}  import them; -> each reward function's calling convention
             and the data set columns it reads
    probe    {}                   build one instance of each factory -> its tools (JSON schemas by transformers'
                                  get_json_schema), whether it has get_reward, what it declares about sessions
    reset    {key, env, row}      the instance `key` (built on first use) reset with the row -> observation
    call     {key, name, arguments}  one tool call -> {content, failed}, as TRL makes them (the result as str; an
                                  exception as the text of {"error": ...}, counted as a failure)
    rewards  {keys, envs, ...}    each reward function over these episodes (TRL's convention: prompts, completions,
                                  completion_ids, environments=, the columns; or ours: prompt and response texts
                                  and the columns) and each environment's get_reward -> values (None allowed) or
                                  the error of a function that raised

Nothing here imports torch or the project's model code (only models/specs.py): a worker starts in a fraction of a
second, and a user's environment imports nothing of ours. The worker exits when its parent is gone.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import sys
import threading
import time
import traceback

from models.specs import import_object

PARENT_PID_ENV = "RLHF_PARENT_PID"
RESERVED = ("prompts", "completions", "completion_ids", "environments", "trainer_state", "log_extra", "log_metric")


def tool_methods(cls) -> list[str]:
    """The tools of an environment class as TRL finds them: its public functions other than reset and get_reward
    (listed on the class, so a property is never evaluated)."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def run(value):
    """A coroutine's result (an async tool, reset or get_reward), or the value as it is."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def calling_convention(fn) -> dict:
    """How a reward function is called: TRL's ('trl': it has a `completions` parameter; keyword arguments prompts,
    completions, completion_ids, environments and the columns) or ours ('ours': fn(prompts, responses, **columns)
    with texts); and the columns it reads (required, optional) or all of them (`any`)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return {"style": "ours", "required": [], "optional": [], "any": False, "accepts": []}
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    any_column = any(p.kind == p.VAR_KEYWORD for p in params)
    if "completions" in names:
        rest = [p for p in params if p.name not in RESERVED and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        style = "trl"
    else:
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
        rest = [p for p in params if p not in positional and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        style = "ours"
    return {"style": style, "required": sorted(p.name for p in rest if p.default is p.empty),
            "optional": sorted(p.name for p in rest if p.default is not p.empty), "any": any_column,
            "accepts": names}


class Worker:
    def __init__(self):
        self.factories: dict = {}
        self.rewards: list = []
        self.instances: dict = {}  # key -> (env name, instance)

    def load(self, factories: dict, rewards: list) -> dict:
        self.factories = {name: import_object(spec, f"environment.factory{'.' + name if name else ''}", "class",
                                              "environment")
                          for name, spec in factories.items()}
        self.rewards = [import_object(spec, f"reward.functions[{i}]") for i, spec in enumerate(rewards)]
        bad = [spec for spec, fn in zip(rewards, self.rewards) if not callable(fn)]
        if bad:
            raise ValueError(f"reward.functions: {bad[0]!r} is not callable")
        return {"rewards": [calling_convention(fn) for fn in self.rewards]}

    def probe(self) -> dict:
        from transformers.utils import get_json_schema  # heavy (~1 s): only the probe renders tool schemas

        out = {}
        for name, factory in self.factories.items():
            field = f"environment.factory{'.' + name if name else ''}"
            instance = factory()
            cls = type(instance)
            if not callable(getattr(instance, "reset", None)):
                raise ValueError(f"{field}: {cls.__name__} has no callable reset(**row) (TRL's environment_factory "
                                 f"protocol: every environment defines one)")
            schemas = []
            for method in tool_methods(cls):
                try:
                    schemas.append(get_json_schema(getattr(instance, method)))
                except Exception as exc:  # noqa: BLE001 - transformers raises several kinds for a bad docstring
                    raise ValueError(f"{field}: the tool {cls.__name__}.{method} has no JSON schema: "
                                     f"{type(exc).__name__}: {exc} (type hints and a Google-style docstring with "
                                     f"every argument under Args:)") from None
            concurrent = getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", None)
            out[name] = {"class": cls.__name__, "tools": schemas,
                         "has_reward": callable(getattr(instance, "get_reward", None)),
                         "concurrent": None if concurrent is None else bool(concurrent)}
        return out

    def reset(self, key: str, env: str, row: dict):
        if key not in self.instances:
            self.instances[key] = (env, self.factories[env]())
        elif self.instances[key][0] != env:
            self.instances[key] = (env, self.factories[env]())
        observation = run(self.instances[key][1].reset(**row))
        if observation is not None and not isinstance(observation, str):
            raise TypeError(f"reset returned {type(observation).__name__}; an observation is a string or None "
                            f"(multimodal observations are not supported)")
        return observation

    def instance(self, key: str):
        if key not in self.instances:
            raise LookupError(f"no environment instance {key!r} in this worker")
        return self.instances[key][1]

    def call(self, key: str, name: str, arguments) -> dict:
        """One tool call, as TRL's tool loop makes it: an exception is the model's to see, as {"error": ...}."""
        instance = self.instance(key)
        try:
            if name not in tool_methods(type(instance)):
                raise ValueError(f"Tool {name} not found.")
            if not isinstance(arguments, dict):
                raise TypeError(f"arguments must be an object, got {type(arguments).__name__}")
            result = run(getattr(instance, name)(**arguments))
        except Exception as exc:  # noqa: BLE001 - a tool's failure is an answer for the model, as in TRL
            return {"content": str({"error": str(exc)}), "failed": True}
        return {"content": result if isinstance(result, str) else str(result), "failed": False}

    def scores(self, keys: list[str], columns: list[dict], prompts: list, completions: list, completion_ids: list,
               prompt_texts: list[str], completion_texts: list[str]) -> dict:
        """Each reward function's values over these episodes (or its error) and each environment's get_reward."""
        environments = [self.instance(key) for key in keys]
        functions = []
        for fn in self.rewards:
            try:
                functions.append({"values": checked(call_reward(fn, environments, columns, prompts, completions,
                                                                completion_ids, prompt_texts, completion_texts),
                                                    len(keys), getattr(fn, "__name__", "reward"))})
            except Exception as exc:  # noqa: BLE001 - counted and shown by the trainer, the run goes on
                functions.append({"error": f"{type(exc).__name__}: {exc}"})
        env_rewards = []
        for environment in environments:
            if not callable(getattr(environment, "get_reward", None)):
                env_rewards.append({"value": None})
                continue
            try:
                env_rewards.append({"value": checked([run(environment.get_reward())], 1, "get_reward")[0]})
            except Exception as exc:  # noqa: BLE001 - as above
                env_rewards.append({"error": f"{type(exc).__name__}: {exc}"})
        return {"functions": functions, "environments": env_rewards}


def call_reward(fn, environments, columns, prompts, completions, completion_ids, prompt_texts, completion_texts):
    convention = calling_convention(fn)
    names = sorted({k for row in columns for k in row})
    wanted = names if convention["any"] else [n for n in names if n in convention["required"] + convention["optional"]]
    missing = sorted(set(convention["required"]) - set(names))
    if missing:
        raise ValueError(f"needs the column(s) {missing}; the rows have {names}")
    kwargs = {name: [row.get(name) for row in columns] for name in wanted}
    if convention["style"] == "trl":
        extra = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                 "environments": environments}
        kwargs.update({k: v for k, v in extra.items() if convention["any"] or k in convention["accepts"]})
        return run(fn(**kwargs))
    return run(fn(prompt_texts, completion_texts, **kwargs))


def checked(values, n: int, name: str) -> list:
    """Reward values: one per episode, each a finite number or None (TRL: None = not scored by this function)."""
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{name} returned {len(values)} rewards for {n} episodes")
    for v in values:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise ValueError(f"{name} returned {v!r}: a reward is a finite number or None")
    return [None if v is None else float(v) for v in values]


def watch_parent() -> None:
    """Exit (code 3) once the process that started this worker is gone, whatever the main thread is doing."""
    parent = int(os.environ.get(PARENT_PID_ENV, "0") or 0)
    if not parent:
        return

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv: list[str]) -> int:
    watch_parent()
    worker = Worker()
    handlers = {"load": worker.load, "probe": worker.probe, "reset": worker.reset, "call": worker.call,
                "rewards": worker.scores}
    with os.fdopen(int(argv[0]), "rb") as requests, os.fdopen(int(argv[1]), "wb") as answers:
        for line in requests:
            request = json.loads(line)
            try:
                answer = {"ok": True, "result": handlers[request.pop("op")](**request)}
            except Exception as exc:  # noqa: BLE001 - every failure is an answer; the trainer decides
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                          "trace": "".join(traceback.format_exc().splitlines(keepends=True)[-12:])}
            answers.write(json.dumps(answer, default=str).encode() + b"\n")
            answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
