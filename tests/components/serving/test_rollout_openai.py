"""The rollout server's OpenAI-compatible endpoints (components/serving/rollout/openai.py) on one real server (vLLM
CPU in .venv-vllm) serving a tiny Qwen2.5-format chat model that calls a tool (tests/components/serving/
tool_model.py): the OpenAI python client and verifiers' own clients (in .venv-verifiers, requests built by their own
code) against it, the weights version on every answer, logprobs of the new weights after a refit for a prompt seen
before (the prefix cache), and refusals in vLLM's error shape naming the field."""

import json
import math
import os
import shutil
import subprocess
import textwrap


import httpx
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from components.launch.processes import PROJECT_ROOT
from components.serving.launcher import launch_rollout, rollout_python
from components.serving.rollout.client import RolloutClient
from components.verifiers.rollouts import VerifiersError, VerifiersWorker, verifiers_python
from components.handshake import run_client
from models.config import from_layers
from models.resolve import pin
from models.engines import Weights
from tests.components.serving.tool_model import CALL, build_tool_model, perturb

RUN = "test-rollout-openai/1"
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("tool-model"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    state = tmp_path_factory.mktemp("rollout")
    cfg = pin(from_layers({"model": {"policy": str(model_dir)},
                           "rollout": {"engine": "vllm", "vllm": {"dtype": "float32"}},
                           "deploy": {"state_dir": str(state), "rollout": {"port": 0, "threads": 1}}}))
    rollout_python(cfg)  # a missing .venv-vllm fails here, naming `make vllm-venv`
    verifiers_python()  # and a missing .venv-verifiers, naming `make verifiers-venv`
    with launch_rollout(cfg, state / "rollout-server.log") as proc:
        proc.wait_until_ready(300)
        yield proc
    assert proc.poll() is not None and not proc.group_members()


@pytest.fixture(scope="module")
def http(server):
    with run_client(server.secret, "rollout", base_url=server.url, timeout=120) as client:
        yield client


def in_verifiers_venv(script: str, server, timeout_s: float = 300) -> dict:
    """Run `script` in .venv-verifiers (its `openai` client) with the server's URL and the run's secret in its
    environment; it prints one JSON document."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(RLHF_RUN_SECRET=server.secret, SERVER_URL=server.url)
    done = subprocess.run([verifiers_python(), "-c", textwrap.dedent(script)], env=env, capture_output=True,
                          timeout=timeout_s, cwd=PROJECT_ROOT)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


OPENAI_CLIENT = """
import json, os, openai
from components.handshake import run_client  # the server proves itself, each request is signed: no secret is sent
client = openai.OpenAI(base_url=os.environ["SERVER_URL"] + "/v1", api_key="unused", max_retries=0,
                       http_client=run_client(os.environ["RLHF_RUN_SECRET"], "rollout", timeout=120))
model = client.models.list().data[0].id
tools = json.loads(os.environ.get("TOOLS", "[]"))
answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "2 + 3?"}], tools=tools,
                                        logprobs=True, top_logprobs=2, max_completion_tokens=32, temperature=1.0,
                                        seed=3, extra_body={"return_token_ids": True})
choice = answer.choices[0]
out = {"model": model, "finish_reason": choice.finish_reason, "content": choice.message.content,
       "tool_calls": [[c.id, c.type, c.function.name, c.function.arguments] for c in choice.message.tool_calls or []],
       "logprobs": [[t.token, t.logprob, t.bytes, [[x.token, x.logprob] for x in t.top_logprobs]]
                    for t in choice.logprobs.content],
       "token_ids": choice.model_extra["token_ids"], "prompt_token_ids": answer.model_extra["prompt_token_ids"],
       "weights_version": answer.model_extra["weights_version"], "usage": answer.usage.model_dump()}
raw = client.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": "x"}],
                                                       max_tokens=2)
out["header"] = raw.headers.get("x-weights-version")
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], tools=tools,
                                   tool_choice="required")
except openai.BadRequestError as exc:
    out["refused"] = [exc.status_code, exc.body]
print(json.dumps(out))
"""


def test_the_openai_client_reads_models_chat_tool_calls_logprobs_and_token_ids(server, http, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = in_verifiers_venv(OPENAI_CLIENT.replace('os.environ.get("TOOLS", "[]")', repr(json.dumps(TOOLS))), server)
    assert out["model"] == str(model_dir)
    assert out["finish_reason"] == "tool_calls" and out["content"] is None
    [(call_id, kind, name, arguments)] = out["tool_calls"]
    assert call_id.startswith("chatcmpl-tool-") and kind == "function" and name == CALL["name"]
    assert json.loads(arguments) == CALL["arguments"]
    ids = out["token_ids"]
    assert tok.decode(ids).startswith("<tool_call>") and ids[-1] == tok.eos_token_id
    assert [t[0] for t in out["logprobs"]] == [tok.decode([i]) for i in ids]
    assert all(t[2] == list(t[0].encode()) and len(t[3]) == 2 and t[3][0][1] >= t[3][1][1] for t in out["logprobs"])
    assert all(t[1] <= 0 for t in out["logprobs"])
    # the prompt is the model's chat template with the tools, as /tokenize renders it
    tokenized = http.post("/tokenize", json={"messages": [{"role": "user", "content": "2 + 3?"}], "tools": TOOLS})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == out["prompt_token_ids"] == tok.apply_chat_template(
        [{"role": "user", "content": "2 + 3?"}], tools=TOOLS, add_generation_prompt=True, tokenize=True,
        return_dict=False)
    assert tokenized.json()["count"] == len(out["prompt_token_ids"]) and tokenized.json()["max_model_len"] == 2048
    assert out["usage"]["prompt_tokens"] == len(out["prompt_token_ids"])
    assert out["usage"]["completion_tokens"] == len(ids)
    assert int(out["header"]) == out["weights_version"]
    status, body = out["refused"]
    assert status == 400 and body["param"] == "tool_choice" and "'required' is not supported" in body["message"]


def test_a_call_cut_short_is_content_counted_and_the_token_routes_answer(server, http):
    before = http.get("/health").json()["tool_calls"]["malformed"]
    answer = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                                      "max_tokens": 4, "return_token_ids": True}).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith("<tool_call>") and choice["tool_parse_error"]
    assert http.get("/health").json()["tool_calls"]["malformed"] == before + 1
    # /v1/chat/completions/tokens: the prompt given as ids gives the same answer as the messages it renders
    tokens = http.post("/v1/chat/completions/tokens", json={
        "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tokens": answer["prompt_token_ids"],
        "max_tokens": 4, "return_token_ids": True, "logprobs": True}).json()
    assert tokens["prompt_token_ids"] == answer["prompt_token_ids"]
    assert tokens["choices"][0]["token_ids"] == choice["token_ids"]
    assert len(tokens["choices"][0]["logprobs"]["content"]) == 4
    # /inference/v1/generate: token ids in, ids, logprobs and the weights version of each token out
    generated = http.post("/inference/v1/generate",
                          json={"token_ids": answer["prompt_token_ids"], "return_token_ids": True,
                                                          "sampling_params": {"max_tokens": 5, "logprobs": 1, "n": 2}})
    assert generated.status_code == 200, generated.text
    body = generated.json()
    assert body["prompt_token_ids"] == answer["prompt_token_ids"] and len(body["choices"]) == 2
    for c in body["choices"]:
        assert c["token_ids"][:4] == choice["token_ids"] and len(c["logprobs"]["content"]) == 5
        assert [e["token_id"] for e in c["logprobs"]["content"]] == c["token_ids"]
        assert c["weight_versions"] == [{"version": generated.headers["x-weights-version"], "start": 0, "end": 5}]


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", {"messages": "hi"}, 400, "body.messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 64, "max_tokens": 2000}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}, 400, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, 400,
     "chat_template"),
    ("/v1/chat/completions/tokens", {"messages": [], "tokens": [5, 100000]}, 400, "tokens"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 1}, "output_mode": "text"}, 400,
     "output_mode"),
    ("/tokenize", {"messages": [{"content": "no role"}]}, 400, None),
    # vLLM's own checks (its request models' validators, SamplingParams) raise past pydantic's validation: still 400s
    ("/tokenize", {"messages": [], "add_generation_prompt": True, "continue_final_message": True}, 400,
     "continue_final_message, add_generation_prompt"),
    ("/v1/chat/completions/tokens", {"messages": [], "tokens": [5], "temperature": 3.0}, 400, "temperature"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"temperature": 0, "n": 2}}, 400, "n"),
])
def test_bad_requests_are_refused_in_vllms_error_shape_naming_the_field(server, http, path, body, status, param):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"]
    if param:
        assert error["param"] == param, error
    if param == "max_tokens" and "context" in error["message"]:
        assert "maximum context length" in error["message"]  # what verifiers reads as an overlong prompt
    stranger = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert stranger.status_code == 401 and stranger.json()["error"]["param"] == "authorization"


ENVIRONMENTS = {
    "guess_env": '''
        import verifiers as vf
        from datasets import Dataset

        class GuessingGame(vf.MultiTurnEnv):
            """The player guesses a number; the environment says "higher" or "lower" (a MultiTurnEnv)."""

            async def env_response(self, messages, state, **kwargs):
                guess = str(messages[-1].content or "")
                return [vf.UserMessage(content="correct" if state["answer"] in guess else "higher")]

        def load_environment(max_turns: int = 3):
            rows = [{"question": f"Guess my number ({i}).", "answer": str(i)} for i in range(4)]
            rubric = vf.Rubric(funcs=[lambda completion, answer, **kw: float(any(
                answer in str(m.content) for m in completion if m.role == "assistant"))])
            return GuessingGame(dataset=Dataset.from_list(rows), rubric=rubric, max_turns=max_turns)
    ''',
    "calc_env": '''
        import verifiers as vf
        from datasets import Dataset

        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: The first integer.
                b: The second integer.
            """
            return a + b

        def load_environment(max_turns: int = 3):
            rows = [{"question": f"What is 2 + 3? ({i})", "answer": "5"} for i in range(4)]
            rubric = vf.Rubric(funcs=[lambda completion, answer, **kw: float(any(
                m.role == "tool" and str(m.content) == answer for m in completion))])
            return vf.ToolEnv(tools=[add], dataset=Dataset.from_list(rows), rubric=rubric, max_turns=max_turns)
    ''',
}


@pytest.fixture(scope="module")
def environments(tmp_path_factory):
    folder = tmp_path_factory.mktemp("environments")
    for name, source in ENVIRONMENTS.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return folder


def extends(step, previous) -> bool:
    seen = previous["prompt_ids"] + previous["completion_ids"]
    return step["prompt_ids"][:len(seen)] == seen


@pytest.mark.parametrize("client_type", ["openai_chat_completions_token", "openai_chat_completions"])
def test_verifiers_clients_run_a_multiturn_and_a_tool_env_with_tokens_on_every_turn(server, environments, client_type,
                                                                                    tmp_path):
    """verifiers' own clients, through the worker (components/verifiers/worker.py): a MultiTurnEnv and a ToolEnv
    (classic API, written above), 2 examples x 2 rollouts each, 3 turns each: token ids and logprobs on every turn;
    with token ids in, every turn's prompt ids extend the previous turn's prompt + completion ids (one sample per
    rollout); with messages in, how often the re-rendered text did not give back the sampled tokens is measured."""
    failures = turns = 0
    worker = VerifiersWorker(server.secret, tmp_path / "verifiers.log", env_paths=[str(environments)])
    pids = set()
    for env_id in ("guess_env", "calc_env"):  # one worker plays both environments, one batch after the other
        answer = worker.request({"env_id": env_id, "base_url": f"{server.url}/v1", "client_type": client_type,
                                 "sampling_args": {"temperature": 1.0, "max_tokens": 24}, "example_ids": [0, 1],
                                 "rollouts_per_example": 2}, timeout_s=300)
        pids.add(worker.proc.pid)
        rollouts = answer["rollouts"]
        assert len(rollouts) == 4 and [r["example_id"] for r in rollouts] == [0, 0, 1, 1]
        for rollout in rollouts:
            assert rollout["error"] is None and rollout["turns"] == 3, rollout
            for step in rollout["steps"]:
                assert step["completion_ids"] and len(step["completion_logprobs"]) == len(step["completion_ids"])
                assert all(lp <= 0 for lp in step["completion_logprobs"]) and set(step["completion_mask"]) == {1}
            later = list(zip(rollout["steps"][1:], rollout["steps"]))
            turns += len(later)
            failures += sum(not extends(step, previous) for step, previous in later)
            if client_type == "openai_chat_completions_token":
                assert all(extends(step, previous) for step, previous in later)
                [sample] = rollout["samples"]  # the whole rollout is one sample, the environment's tokens masked
                assert sample["completion_ids"][-len(rollout["steps"][-1]["completion_ids"]):] == \
                    rollout["steps"][-1]["completion_ids"]
                assert sum(sample["completion_mask"]) == sum(len(s["completion_ids"]) for s in rollout["steps"])
            if env_id == "calc_env":
                tool_results = [m for m in rollout["messages"] if m["role"] == "tool"]
                assert len(tool_results) == 2 and all(m["content"] == "5" for m in tool_results)
                assert rollout["reward"] == 1.0
    worker.close()
    assert len(pids) == 1 and worker.proc is None  # one process answered both batches; closed, it is gone
    print(f"{client_type}: {failures} of {turns} later turns did not extend the previous prompt + completion ids")
    if client_type == "openai_chat_completions":
        # this tokenizer is byte-level with the tool call's pieces as tokens: the text round-trips exactly
        assert failures == 0


def test_a_batch_that_fails_names_the_workers_exit_and_the_next_batch_gets_a_new_worker(environments, tmp_path):
    """The worker keeps serving a run's batches; one whose batch fails (here: an environment that does not exist)
    exits, the batch fails naming its exit code and log tail, and the next batch starts a new worker. Past its
    deadline a batch kills the worker (its process group) and says so. (Dataset requests: no server needed.)"""
    log = tmp_path / "verifiers.log"
    with VerifiersWorker(None, log, env_paths=[str(environments)]) as worker:
        rows = worker.request({"mode": "dataset", "env_id": "guess_env", "split": "train"})["rows"]
        first = worker.proc.pid
        with pytest.raises(VerifiersError, match=r"(?s)exited with code 1:.*no_such_env"):
            worker.request({"mode": "dataset", "env_id": "no_such_env", "split": "train"})
        assert not psutil.pid_exists(first)
        assert worker.request({"mode": "dataset", "env_id": "guess_env", "split": "train"})["rows"] == rows
        second = worker.proc.pid
        assert second != first
        with pytest.raises(VerifiersError, match=r"did not finish its batch within 0s: killed"):
            worker.request({"mode": "dataset", "env_id": "calc_env", "split": "train"}, timeout_s=0.001)
        assert worker.proc is None and not psutil.pid_exists(second)


def call_probability(model_dir) -> float:
    """P(<tool_call> | the generation prompt's last token "\n") of the model in `model_dir` (context-free: the
    next token depends on the current one only)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    newline = tok.encode("\n", add_special_tokens=False)
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([newline])).logits[0, -1].double(), -1)
    return float(probs[tok.convert_tokens_to_ids("<tool_call>")])


def test_a_run_trains_on_a_verifiers_tool_env_through_the_rollout_server(model_dir, environments, tmp_path):
    """environment.verifiers: the ToolEnv above, played by verifiers' own token client against the run's rollout
    server (the run starts its own, refitted every iteration) trains RLOO: the policy it publishes is not the one it
    started from. The tool model is made uncertain (it starts a tool call after the generation prompt with p ~0.6;
    otherwise it rambles, and scores 0 unless it stumbles on a call). Which way that p moves in two iterations is not
    asserted: Adam's per-weight steps move every token's logit after the prompt, and the turn after a tool reply
    pushes the same logit both ways; measured 0.61 -> 0.20, 0.45, 0.60, 0.85, 0.97 across seeds and machines. That
    RL on environments raises task success is the tools learning check's (tests/models/test_environment_runs.py),
    through the same episode batch builder. The tools and env metrics are logged, and the eval runs on the
    environment's eval rows with pass@k. (How a rollout record becomes one sequence whose loss counts the model's
    tokens only: tests/models/test_environments.py.)"""
    from components.runs import train
    from models.config import preset

    weak = tmp_path / "weak-tool-model"
    shutil.copytree(model_dir, weak)
    model = AutoModelForCausalLM.from_pretrained(weak, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(weak)
    newline, call = tok.encode("\n", add_special_tokens=False)[0], tok.convert_tokens_to_ids("<tool_call>")
    with torch.no_grad():  # the one uncertain step: the call's first token, logit ln(V - 1) over the others'
        model.lm_head.weight[call, newline] *= math.log(len(tok) - 1) / 33.0
    model.save_pretrained(weak)
    before = call_probability(weak)
    assert 0.2 < before < 0.8, before
    cfg = preset("none", **{
        "model.policy": str(weak), "model.dtype": "float32", "algorithm": "rloo", "seed": 0, "run_name": "verifiers",
        "rollout.engine": "vllm", "rollout.vllm.dtype": "float32", "deploy.rollout.threads": 1,
        "reward.source": "function", "kl.beta": 0.0,
        "environment.verifiers": {"id": "calc_env", "paths": [str(environments)], "args": {"max_turns": 2}},
        "generation.max_new_tokens": 48, "generation.temperature": 1.0,
        "reinforce.rollout_batch_size": 2, "reinforce.num_rollouts_per_prompt": 4, "reinforce.minibatch_size": 8,
        "reinforce.epochs": 1, "reinforce.optim.lr": 3e-2, "iterations": 2,
        "eval.every": 2, "eval.max_prompts": 2, "eval.samples_per_prompt": 2, "eval.temperature": 1.0,
        "deploy.state_dir": str(tmp_path / "state"), "deploy.tracking.system_metrics": False})
    result = train(cfg)
    history, evals = result["history"], result["evals"]
    after = call_probability(result["model_dir"])
    print(f"P(tool call) {before:.3f} -> {after:.3f}; success {[m['rewards/calc_env/mean'] for m in history]}")
    assert abs(after - before) > 1e-3  # trained: the published policy is not the initial one
    assert len(history) == 2 and all(m["env/errors"] == 0 and m["tools/call_frequency"] > 0 for m in history)
    assert all(m["env/turns_max"] >= 2 for m in history)  # a call, the tool's reply, the next turn
    assert [e["iteration"] for e in evals] == [0, 2] and all("eval/pass_at_2" in e for e in evals)



def test_after_a_refit_a_prompt_seen_before_gets_the_new_weights_logprobs(server, http, model_dir):
    """(Last in this module: it changes the served weights.) The same prompt before and after a refit: after it, the
    sampled tokens' logprobs are those of an HF forward pass with the new weights (the prefix cache of the old ones is
    reset and every prompt is salted with the weights version), and the answer names the new version."""
    request = {"messages": [{"role": "user", "content": "the same prompt, twice"}], "max_tokens": 12,
               "temperature": 1.0, "seed": 5, "logprobs": True, "return_token_ids": True}
    before = http.post("/v1/chat/completions", json=request)
    version = int(before.headers["x-weights-version"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    perturb(model, 0.3, seed=1)
    state = model.state_dict()
    client = RolloutClient(server.url, RUN, timeout_s=120, secret=server.secret)
    weights = Weights([(name, t.dtype, tuple(t.shape)) for name, t in state.items()], list(state.values()))
    assert client.load_weights(weights, version + 1)["weights_version"] == version + 1
    client.close()
    after = http.post("/v1/chat/completions", json=request)
    assert int(after.headers["x-weights-version"]) == after.json()["weights_version"] == version + 1
    prompt, ids = after.json()["prompt_token_ids"], after.json()["choices"][0]["token_ids"]
    served = [t["logprob"] for t in after.json()["choices"][0]["logprobs"]["content"]]
    assert prompt == before.json()["prompt_token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
    old = [t["logprob"] for t in before.json()["choices"][0]["logprobs"]["content"]]
    assert max(abs(a - b) for a, b in zip(served, expected.tolist())) < 1e-3, (served, expected.tolist())
    assert max(abs(a) for a in old) < 1e-3 < max(abs(a) for a in served)  # the old weights' answer was certain
