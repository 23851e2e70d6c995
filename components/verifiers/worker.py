"""A batch of rollouts of a verifiers environment against the run's rollout server, in verifiers' own environment
(.venv-verifiers, `make verifiers-venv`: verifiers 0.2.1, the classic API), returned as plain JSON.

    python -m components.verifiers.worker < requests.jsonl > answers.jsonl

The run's secret comes in through $RLHF_RUN_SECRET, never on the command line, and never leaves this process: the
OpenAI client verifiers drives has an HTTP client of the run's (components/handshake.py) under it, which has the
server prove it holds the secret on every new connection before anything is sent, and signs every request. It answers
request after request, one JSON line each (the trainer keeps one worker for a run: verifiers and the environment load
once). A request (a JSON line on stdin):

    {"env_id": "my-env", "env_args": {...},            vf.load_environment(env_id, **env_args)
     "base_url": "http://127.0.0.1:P/v1",              the rollout server's OpenAI-compatible endpoints
     "client_type": "openai_chat_completions_token",   or "openai_chat_completions" (messages in, text re-rendered)
     "sampling_args": {"temperature": 1.0, "max_tokens": 64, ...},
     "split": "train", "example_ids": [0, 1, 2],       rows of the environment's dataset (or "eval" dataset)
     "rollouts_per_example": 4, "max_concurrent": 32}

With `"mode": "dataset"` (and `env_id`, `env_args`, `split`) it answers the split's rows instead, as the run's
prompts, `{"schema": 1, "rows": [{"example_id": position, "prompt": [messages]}]}`; no server is needed for it.

The answer (a JSON line on stdout, schema version 1), one entry per rollout, the k rollouts of an example consecutive:

    {"schema": 1, "env_id", "client_type", "model",
     "rollouts": [{"example_id", "reward", "metrics": {name: float}, "error": str|null, "stop_condition",
                   "is_truncated", "turns",
                   "messages": [...],                      the whole conversation (prompt + completion), OpenAI JSON
                   "steps": [{"prompt_ids", "completion_ids", "completion_logprobs", "completion_mask",
                              "is_truncated"}],            one per model turn, as the server sampled it
                   "samples": [{"prompt_ids", "completion_ids", "completion_mask", "completion_logprobs"}]}]}

`samples` are the steps merged as prime-rl merges them: while a step's prompt ids extend the previous sample's
prompt + completion ids, the step joins that sample (the tokens between, the environment's reply, with mask 0 and
logprob 0, then the step's completion); otherwise a new sample starts. A rollout that errored keeps its tokens with
every mask 0 (nothing of it trains). The merge (`merge_steps`) is pure Python, also imported by the trainer's side.

Runs in .venv-verifiers: imports nothing from the project but this package (components/verifiers/__init__.py) and
components/handshake.py (the standard library and httpx only).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from components.handshake import run_async_client

SECRET_ENV = "RLHF_RUN_SECRET"  # as components/serving/auth.py
SCHEMA = 1
ENVIRONMENTS: dict = {}  # (id, arguments) -> the loaded environment, for the worker's life


def merge_steps(steps: list[dict], errored: bool = False) -> list[dict]:
    """A rollout's steps as training samples (prime-rl's rule): a step whose prompt ids extend the current sample's
    prompt + completion ids continues it (the ids between them masked, logprob 0), else starts a new sample."""
    samples: list[dict] = []
    for step in steps:
        prompt, completion = list(step["prompt_ids"]), list(step["completion_ids"])
        mask, logprobs = list(step["completion_mask"]), [float(x) for x in step["completion_logprobs"]]
        if samples:
            last = samples[-1]
            seen = last["prompt_ids"] + last["completion_ids"]
            if prompt[:len(seen)] == seen:
                between = prompt[len(seen):]
                last["completion_ids"] += between + completion
                last["completion_mask"] += [0] * len(between) + mask
                last["completion_logprobs"] += [0.0] * len(between) + logprobs
                continue
        samples.append({"prompt_ids": prompt, "completion_ids": completion, "completion_mask": mask,
                        "completion_logprobs": logprobs})
    if errored:
        for sample in samples:
            sample["completion_mask"] = [0] * len(sample["completion_mask"])
    return samples


def _jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return _jsonable(value.model_dump(exclude_none=True))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def rollout_record(output: dict) -> dict:
    """One rollout of verifiers' RolloutOutput (with its trajectory) as this worker's JSON."""
    steps = []
    for step in output.get("trajectory") or []:
        tokens = step.get("tokens")
        if tokens is None:  # the server answered without token ids: a contract failure, said, not hidden
            raise RuntimeError("a trajectory step has no token ids: the server's answer lacked prompt_token_ids, "
                               "choices[].token_ids or logprobs.content")
        steps.append({"prompt_ids": list(tokens["prompt_ids"]), "completion_ids": list(tokens["completion_ids"]),
                      "completion_logprobs": [float(x) for x in tokens["completion_logprobs"]],
                      "completion_mask": list(tokens["completion_mask"]),
                      "is_truncated": bool(tokens.get("is_truncated", False))})
    error = output.get("error")
    prompt, completion = output.get("prompt") or [], output.get("completion") or []
    return {"example_id": output.get("example_id"), "reward": float(output.get("reward") or 0.0),
            "metrics": {k: float(v) for k, v in (output.get("metrics") or {}).items()
                        if isinstance(v, (int, float))},
            "error": None if error is None else str(_jsonable(error)), "stop_condition": output.get("stop_condition"),
            "is_truncated": bool(output.get("is_truncated")), "turns": len(steps),
            "messages": _jsonable(list(prompt) + list(completion)), "steps": steps,
            "samples": merge_steps(steps, errored=error is not None)}


def dataset_rows(env, split: str) -> list[dict]:
    """The rows of a split as prompts: each row's position (what a rollout request names) and its messages."""
    dataset = env.get_eval_dataset() if split == "eval" else env.get_dataset()
    return [{"example_id": i, "prompt": _jsonable(row["prompt"])} for i, row in enumerate(dataset)]


async def run(request: dict) -> dict:
    import verifiers as vf  # the worker's own environment (.venv-verifiers): not importable in the project's

    key = (request["env_id"], json.dumps(request.get("env_args", {}), sort_keys=True))
    if key not in ENVIRONMENTS:
        ENVIRONMENTS[key] = vf.load_environment(request["env_id"], **request.get("env_args", {}))
    env = ENVIRONMENTS[key]
    if request.get("mode") == "dataset":
        return {"schema": SCHEMA, "env_id": request["env_id"], "rows": dataset_rows(env, request.get("split", "train"))}
    client_type = request.get("client_type", "openai_chat_completions_token")
    if client_type not in CLIENTS:
        raise ValueError(f"client_type: one of {sorted(CLIENTS)}, got {client_type!r}")
    from verifiers import clients  # the worker's own environment, as above

    openai = openai_client(request["base_url"], float(request.get("timeout_s", 600)),
                           int(request.get("max_retries", 0)))
    try:
        return await play(env, request, client_type, getattr(clients, CLIENTS[client_type])(openai), openai)
    finally:
        await openai.close()


async def play(env, request: dict, client_type: str, client, openai) -> dict:
    """The request's rollouts: k per example, at most max_concurrent groups at once."""
    model = request.get("model") or (await openai.models.list()).data[0].id  # the model requests must name
    dataset = env.get_eval_dataset() if request.get("split") == "eval" else env.get_dataset()
    rows = [dataset[int(i)] for i in request.get("example_ids", range(len(dataset)))]
    k = int(request.get("rollouts_per_example", 1))
    sampling = {"logprobs": True, **request.get("sampling_args", {})}
    sampling["extra_body"] = {"return_token_ids": True, **sampling.get("extra_body", {})}
    limit = asyncio.Semaphore(int(request.get("max_concurrent", 32)))

    async def group(row: dict) -> list:
        inputs = [{key: row[key] for key in ("prompt", "answer", "info", "example_id", "task") if key in row}
                  for _ in range(k)]
        async with limit:
            return await env.run_group(inputs, client, model, sampling, state_columns=["trajectory"])

    groups = await asyncio.gather(*(group(row) for row in rows))
    return {"schema": SCHEMA, "env_id": request["env_id"], "client_type": client_type, "model": model,
            "rollouts": [rollout_record(dict(output)) for outputs in groups for output in outputs]}


CLIENTS = {"openai_chat_completions": "OpenAIChatCompletionsClient",  # verifiers' client of each client_type
           "openai_chat_completions_token": "OpenAIChatCompletionsTokenClient"}


def openai_client(base_url: str, timeout_s: float, max_retries: int):
    """An OpenAI client of the rollout server whose HTTP client proves the server and signs each request with the
    run's key (its `api_key` is never checked, nor sent as a credential: the signature replaces it)."""
    from openai import AsyncOpenAI  # comes with verifiers, in the worker's own environment

    return AsyncOpenAI(base_url=base_url, api_key="signed-per-request", max_retries=max_retries, timeout=timeout_s,
                       http_client=run_async_client(os.environ[SECRET_ENV], "rollout", timeout=timeout_s))


def main() -> None:
    """Answer each request line on stdin with one answer line on stdout, until stdin ends; one event loop and one
    instance of each environment (by id and arguments) for all of them. A request that fails ends the worker (its
    traceback in the log, a non-zero exit code): the trainer reports it and starts another for the next batch."""
    loop = asyncio.new_event_loop()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("mode") != "dataset" and not os.environ.get(SECRET_ENV):
            raise SystemExit(f"${SECRET_ENV}: the run's secret is needed (the rollout server serves its run only)")
        sys.stdout.write(json.dumps(loop.run_until_complete(run(request))) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
