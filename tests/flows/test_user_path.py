"""The walk a new user takes on the local stack (issue 31's acceptance): on an empty state directory, their model
under an `org/name` hub id in the Hugging Face cache (a small Qwen2 with its own BPE tokenizer and chat template, and
a reward model of its family), `rlhf up`, then `prefect deployment run reinforce/default` and `ppo/default` with a
partial config naming a parquet with question/answer columns and a reward file outside any package. The deployments'
own parameters are kept; no gold reward is logged; the progress artifact reaches 100; MLflow holds each run's model
(registered when asked); `rlhf export` gives a model plain transformers loads; `rlhf down` leaves nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from components.launch import stack
from tests.conftest import free_port_block
from tests.hub_cache import build_qwen2, put_in_cache

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REWARDS = '''import re

def exact(prompts, responses, answer):
    out = []
    for response, solution in zip(responses, answer):
        numbers = re.findall(r"-?\\d+", response)
        out.append(1.0 if numbers and numbers[-1] == solution.split("####")[-1].strip() else 0.0)
    return out
'''


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("user-path")
    cache = root / "hf-cache"
    put_in_cache(build_qwen2(root / "build" / "policy"), cache, "acme/tiny-qwen")
    put_in_cache(build_qwen2(root / "build" / "reward", reward=True), cache, "acme/tiny-qwen-rm")
    rows = [{"question": f"what is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}. #### {a + b}"}
            for a in range(8) for b in range(8)]
    datasets.Dataset.from_list(rows).to_parquet(str(root / "math.parquet"))
    (root / "my_rewards.py").write_text(REWARDS)
    state = root / "state"
    prefect_port, mlflow_port = free_port_block(1), free_port_block(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(cache))  # the stack's processes (and their children) read this cache
        mp.setenv("PREFECT_RUNNER_POLL_FREQUENCY", "1")
        urls = stack.up(state, prefect_port, mlflow_port, set_profile=False, log=lambda *_: None)
    env = {**stack.base_env(state, prefect_port, mlflow_port), "COLUMNS": "1000", "HF_HUB_CACHE": str(cache)}
    try:
        yield {"root": root, "state": state, "urls": urls, "env": env, "api": env["PREFECT_API_URL"]}
    finally:
        stack.down(state, log=lambda *_: None)


def run_deployment(w, name: str, config: dict) -> dict:
    proc = subprocess.run([str(BIN / "prefect"), "deployment", "run", name, "--param", f"config={json.dumps(config)}"],
                          env=w["env"], capture_output=True, text=True, timeout=120, check=True)
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", proc.stdout).group(1)
    deadline = time.time() + 400
    while time.time() < deadline:
        run = httpx.get(f"{w['api']}/flow_runs/{run_id}", timeout=10).json()
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED"):
            return run
        time.sleep(1)
    raise TimeoutError(f"{name} flow run {run_id} not final: {run['state']}")


@pytest.mark.parametrize("deployment, config", [
    ("reinforce/default", {"run_name": "walk-rloo", "reward": {"source": "function", "function": "{root}/my_rewards.py:exact"},
                           "reinforce": {"rollout_batch_size": 8, "num_rollouts_per_prompt": 2},
                           "tracking": {"register_as": "walk-model"}}),
    ("ppo/default", {"run_name": "walk-ppo", "model": {"reward": "acme/tiny-qwen-rm"}, "ppo": {"rollout_batch_size": 8}}),
])
def test_a_users_model_data_and_reward_through_the_deployments(walk, deployment, config):
    from mlflow import MlflowClient

    root = walk["root"]
    config = json.loads(json.dumps(config).replace("{root}", str(root)))
    partial = {"iterations": 2, "data": {"prompts": str(root / "math.parquet"), "prompt_key": "question"},
               "generation": {"max_new_tokens": 12}, **config,
               "model": {"policy": "acme/tiny-qwen", "dtype": "float32", **config.get("model", {})}}
    before = stack.prefect_post(walk["api"], "/deployments/filter", {}).json()
    run = run_deployment(walk, deployment, partial)
    assert run["state"]["type"] == "COMPLETED", run["state"]["message"]
    after = httpx.get(f"{walk['api']}/deployments/{run['deployment_id']}", timeout=10).json()
    assert after["parameters"] == next(d for d in before if d["id"] == run["deployment_id"])["parameters"]
    artifacts = stack.prefect_post(walk["api"], "/artifacts/filter",
                                   {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}}).json()
    assert [a["data"] for a in artifacts if a["type"] == "progress"] == [100]

    client = MlflowClient(walk["urls"]["mlflow"])
    experiment = client.get_experiment_by_name("rlhf-flows")
    mrun = client.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{config['run_name']}'")[0]
    assert "objective/gold_reward" not in mrun.data.metrics and "reward" in mrun.data.metrics
    models = client.search_logged_models(experiment_ids=[experiment.experiment_id],
                                         filter_string=f"source_run_id = '{mrun.info.run_id}'")
    assert [str(m.status) for m in models] == ["READY"]
    if "register_as" in config.get("tracking", {}):
        assert "rewards/exact/mean" in mrun.data.metrics
        assert [v.run_id for v in client.search_model_versions("name='walk-model'")] == [mrun.info.run_id]

    out = root / f"exported-{config['run_name']}"
    subprocess.run([str(BIN / "rlhf"), "export", config["run_name"], "--out", str(out)], env=walk["env"], check=True,
                   capture_output=True, text=True, timeout=300)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "what is 1 plus 2?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert model.generate(**prompt, max_new_tokens=4, do_sample=False).shape[1] > prompt["input_ids"].shape[1]


def test_down_leaves_nothing(walk):
    """Last in this module: `rlhf down` stops every process of the stack (and of its runs)."""
    stack.down(walk["state"], log=lambda *_: None)
    alive = [p for p in psutil.process_iter(["pid"]) if _of_stack(p, walk["state"])]
    assert alive == [], [p.cmdline() for p in alive]


def _of_stack(process: psutil.Process, state: Path) -> bool:
    try:
        return process.environ().get("RLHF_STATE_DIR") == str(state)
    except psutil.Error:
        return False
