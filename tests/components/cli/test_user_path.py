"""The path a new user walks, with `rlhf` as they run it (subprocesses, offline): their own model by its hub id from
the Hugging Face cache (a small Qwen2 with its own BPE tokenizer and chat template, put there in the hub's layout),
their data (question/answer columns), their reward in a file outside any package, a partial config; no gold reward
for data that is not the shipped task; a progress bar with the time left; the trained model out: in the run's store,
in MLflow as the run's (registered) model, and through `rlhf export`, loadable and usable with plain transformers.
And the shipped examples (examples/*.yaml) run as they are, only the model and data swapped for small ones."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from components.cli.main import main
from tests.hub_cache import build_qwen2, put_in_cache

pytestmark = pytest.mark.slow(2)

RLHF = str(Path(sys.executable).parent / "rlhf")
ROOT = Path(__file__).resolve().parents[3]
REWARDS = '''import re

def exact(prompts, responses, answer):
    """1 when the response's last number is the answer after '####'."""
    out = []
    for response, solution in zip(responses, answer):
        numbers = re.findall(r"-?\\d+", response)
        out.append(1.0 if numbers and numbers[-1] == solution.split("####")[-1].strip() else 0.0)
    return out
'''


def math_rows(n: int) -> list[dict]:
    return [{"question": f"what is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}. #### {a + b}"}
            for a in range(8) for b in range(8)][:n]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A user's machine: a hub cache with their model (and a reward model of its family), a working directory with
    their data and reward file."""
    import datasets

    root = tmp_path_factory.mktemp("user")
    cache = root / "hf-cache"
    policy = build_qwen2(root / "build" / "policy")
    for repo in ("acme/tiny-qwen", "Qwen/Qwen2.5-0.5B-Instruct"):
        put_in_cache(policy, cache, repo)
    put_in_cache(build_qwen2(root / "build" / "reward", reward=True), cache, "acme/tiny-qwen-rm")
    work = root / "work"
    work.mkdir()
    datasets.Dataset.from_list(math_rows(48)).to_parquet(str(work / "math.parquet"))
    (work / "my_rewards.py").write_text(REWARDS)
    gsm = root / "gsm8k-like"  # a local copy of a GSM8K-shaped data set: configuration `main`, train and test
    for split, rows in (("train", math_rows(48)), ("test", math_rows(64)[48:])):
        (gsm / "main").mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(rows).to_parquet(str(gsm / "main" / f"{split}-00000-of-00001.parquet"))
    (gsm / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: "
                                   "main/train-*\n  - split: test\n    path: main/test-*\n---\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), RLHF_STATE_DIR=str(root / "state"))
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    return {"root": root, "work": work, "gsm": gsm, "env": env, "policy": policy, "state": root / "state"}


def documented(names) -> list[str]:
    """The metric names that docs/metrics.md does not describe (its tables' first column: `a/b`, `a/<name>/mean`,
    shorthand `/max` after a full name)."""
    patterns = []
    for line in html.unescape((ROOT / "docs" / "metrics.md").read_text()).splitlines():  # `time/&lt;phase>`
        if not line.startswith("| `"):
            continue
        last = None
        for token in re.findall(r"`([^`]+)`", line.split("|")[1]):
            full = last.rsplit("/", 1)[0] + token if token.startswith("/") and last else token
            patterns.append(re.compile(re.sub(r"<[^>]+>", r"[^/]+", re.escape(full)) + "$"))
            last = full
    return [n for n in names if not any(p.match(n) for p in patterns)]


def rlhf(user, *args, cwd=None):
    proc = subprocess.run([RLHF, *args], capture_output=True, text=True, timeout=600, env=user["env"],
                          cwd=cwd or user["work"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_a_users_model_data_and_reward_file_train_and_the_model_comes_out(user):
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModelStatus
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = user["work"]
    (work / "run.yaml").write_text(yaml.safe_dump({  # a partial config, as a user writes one
        "algorithm": "rloo", "run_name": "walk", "iterations": 3,
        "model": {"policy": "acme/tiny-qwen", "dtype": "float32"},
        "data": {"prompts": "math.parquet", "prompt_key": "question", "chat_template": True},
        "reward": {"source": "function", "function": "my_rewards.py:exact"},
        "generation": {"max_new_tokens": 12},
        "reinforce": {"rollout_batch_size": 8, "num_rollouts_per_prompt": 2, "minibatch_size": 16,
                      "optim": {"lr": 1e-4}},
        "tracking": {"register_as": "tiny-math"},
        "deploy": {"tracking": {"system_metrics": False}}}))
    proc = rlhf(user, "train", "--config", "run.yaml", "--summary-out", "summary.json")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("iteration ")]
    assert len(lines) == 3 and not any("gold" in line for line in lines), proc.stdout
    frames = proc.stderr.replace("\r", "\n")
    assert re.search(r"iterations: 100%\|.*\| 3/3 \[\d\d:\d\d<\d\d:\d\d", frames), frames[-2000:]

    summary = json.loads((work / "summary.json").read_text())
    store = user["state"] / "checkpoints" / "walk"
    assert summary["model"] == (store / "model").as_uri() and summary["iteration"] == 3
    assert all(m["rewards/exact/mean"] == m["reward"] for m in summary["history"])  # one function, weight 1
    assert not any("objective/gold_reward" in m for m in summary["history"])
    assert documented(summary["history"][-1]) == []  # docs/metrics.md describes every metric the run logs

    # MLflow holds the run's model (a logged model of the run, registered as asked), and no gold reward
    client = MlflowClient(f"sqlite:///{user['state'] / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    assert "objective/gold_reward" not in run.data.metrics and "rewards/exact/mean" in run.data.metrics
    logged = client.get_logged_model(summary["mlflow_model_id"])
    assert logged.source_run_id == run.info.run_id and logged.status == LoggedModelStatus.READY
    versions = client.search_model_versions("name='tiny-math'")
    assert [(str(v.version), v.run_id, v.source) for v in versions] == [("1", run.info.run_id,
                                                                         logged.artifact_location)]

    # `rlhf export` of the last checkpoint (the console script's entry point, in this process): what the run left in
    # its store, and plain transformers loads it
    with pytest.MonkeyPatch.context() as mp:
        for key in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "RLHF_STATE_DIR"):
            mp.setenv(key, user["env"][key])
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.chdir(work)
        assert main(["export", "walk", "--iteration", "3", "--out", str(work / "exported")]) == 0
    exported = load_file(str(work / "exported" / "model.safetensors"))
    stored = load_file(str(store / "model" / "model.safetensors"))
    assert exported.keys() == stored.keys() and all(torch.equal(exported[k], stored[k]) for k in stored)
    start = load_file(str(user["policy"] / "model.safetensors"))
    moved = max(float((exported[k] - start[k]).abs().max()) for k in start)
    assert moved > 0, "training did not move the weights"
    model = AutoModelForCausalLM.from_pretrained(work / "exported")
    tokenizer = AutoTokenizer.from_pretrained(work / "exported")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "what is 2 plus 3?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id, tokenizer.pad_token_id]


def test_the_examples_run_as_shipped_with_the_model_and_data_swapped(user):
    """examples/ppo_gsm8k.yaml through `rlhf train` (its critic and reward model from the cached model's family),
    examples/rloo_gsm8k.yaml prepared and its data read as a run does (the training path of reward files is the
    test above); the model id is the example's own, cached here as the small stand-in."""
    from models.config import load_config
    from models.loop import read_data
    from models.prepare import prepare_run

    data = {"data.prompts": str(user["gsm"]), "eval.prompts": str(user["gsm"])}
    with pytest.MonkeyPatch.context() as mp:
        for key in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "RLHF_STATE_DIR"):
            mp.setenv(key, user["env"][key])
        mp.chdir(ROOT)
        rloo = prepare_run(load_config(ROOT / "examples" / "rloo_gsm8k.yaml", overrides=data))
        prompts, evals = read_data(rloo)
    assert rloo.model.policy == "Qwen/Qwen2.5-0.5B-Instruct" and rloo.reinforce.optim.lr == 1e-6
    assert rloo.reward.functions == [f"{ROOT / 'examples' / 'rewards' / 'gsm8k.py'}:{name}"
                                     for name in ("exact_match", "answer_format")]
    assert len(prompts) == 48 and len(evals) == 16 and prompts.templated is False

    sizes = ["iterations=1", "ppo.rollout_batch_size=4", "ppo.minibatch_size=4", "critic.train_batch_size=4",
             "eval.max_prompts=4", "eval.every=1", "generation.max_new_tokens=8", "run_name=ppo-example",
             "reward.source=model", "model.reward=acme/tiny-qwen-rm", "deploy.tracking.system_metrics=false"]
    sets = [arg for item in [*[f"{k}={v}" for k, v in data.items()], *sizes] for arg in ("--set", item)]
    proc = rlhf(user, "train", "--config", "examples/ppo_gsm8k.yaml", *sets, "--summary-out",
                str(user["root"] / "ppo.json"), cwd=ROOT)
    summary = json.loads((user["root"] / "ppo.json").read_text())
    assert summary["iterations"] == 1 and [e["iteration"] for e in summary["evals"]] == [0, 1], proc.stdout
    assert documented([*summary["history"][-1], *summary["evals"][-1]]) == []
    assert "model.critic" not in proc.stdout  # no complaint: the critic starts from the family's reward model
    assert (user["state"] / "checkpoints" / "ppo-example" / "model" / "model.safetensors").is_file()
