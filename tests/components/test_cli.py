"""The `rlhf` console script as a user runs it (subprocess, offline)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

RLHF = str(Path(sys.executable).parent / "rlhf")


def run(*args, env=None, check=True):
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([RLHF, *args], capture_output=True, text=True, timeout=600, env=full_env, check=check)


def test_models_tiny_is_deterministic_and_loads_offline(tiny_models, tmp_path):
    out = tmp_path / "tiny"
    proc = run("models", "tiny", "--out", str(out), "--seed", "0")
    info = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert Path(info["paths"]["policy"]).is_dir()
    for name in ("policy", "reward", "critic"):
        ours = load_file(str(out / name / "model.safetensors"))
        fixture = load_file(str(Path(tiny_models[name]) / "model.safetensors"))
        assert ours.keys() == fixture.keys()
        assert all(torch.equal(ours[k], fixture[k]) for k in ours), f"{name}: same seed must give identical weights"
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

    AutoTokenizer.from_pretrained(out / "policy")
    assert AutoModelForCausalLM.from_pretrained(out / "policy").config.n_layer == 2
    assert AutoModelForSequenceClassification.from_pretrained(out / "reward").config.num_labels == 1
    assert AutoModelForTokenClassification.from_pretrained(out / "critic").config.num_labels == 1


def test_config_errors_name_the_field():
    proc = run("config", "--set", "ppo.optim.lr=-1", check=False)
    assert proc.returncode != 0 and "lr" in proc.stderr and "greater than 0" in proc.stderr
    proc = run("config", "--set", "reinforce.num_rollouts_per_prompt=1", check=False)
    assert proc.returncode != 0 and "num_rollouts_per_prompt" in proc.stderr


def test_train_in_process(tiny_models, tmp_path):
    metrics = tmp_path / "m.json"
    proc = run("train", "--set", "algorithm=rloo", "--set", "iterations=2", "--set", f"model.policy={tiny_models['policy']}",
               "--set", f"model.reward={tiny_models['reward']}", "--metrics-out", str(metrics))
    assert "iteration 2/2" in proc.stdout
    history = json.loads(metrics.read_text())
    assert len(history) == 2 and history[1]["episode"] == 2 * 16 * 4


def test_two_runs_on_an_empty_state_dir_build_the_embedded_default_once(tmp_path):
    """The first run on a fresh machine builds the tiny models; two started together do not race or half-write."""
    state = tmp_path / "state"
    args = [RLHF, "train", "--set", "algorithm=rloo", "--set", "iterations=1", "--set", "reinforce.rollout_batch_size=4",
            "--set", "generation.max_new_tokens=4"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", RLHF_STATE_DIR=str(state))
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all("iteration 1/1" in out for out in outputs), outputs
    assert sum("building the embedded default models" in out for out in outputs) == 1, outputs
    tiny = state / "models" / "tiny"
    assert json.loads((tiny / "tiny.json").read_text())["paths"]["policy"] == str(tiny / "policy")
    assert sorted(p.name for p in (state / "models").iterdir()) == [".tiny.lock", "tiny"]  # no half-written leftovers


def test_a_model_path_that_does_not_exist_fails_fast_naming_the_field(tmp_path):
    proc = run("train", "--set", f"model.policy={tmp_path / 'no-such-model'}", "--set", "iterations=1",
               env={"RLHF_STATE_DIR": str(tmp_path / "state")}, check=False)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rlhf train failed: FileNotFoundError: model.policy: model path") and "no-such-model" in last
    assert not (tmp_path / "state" / "models").exists()  # a path the user gave is never replaced by the default


@pytest.mark.parametrize("algorithm", ["ppo", "rloo"])
def test_train_on_two_ranks_learns_the_shipped_task(tiny_models, tmp_path, algorithm):
    """`rlhf train --set actor.nproc_per_node=2`: rank 0 starts rank 1, both shard the actor (FSDP2 over gloo) and
    the run learns by the margin of the single-process learning test (tests/models/test_steps.py)."""
    metrics = tmp_path / "m.json"
    run("train", "--set", f"algorithm={algorithm}", "--set", "actor.nproc_per_node=2", "--set", "iterations=12",
        "--set", f"model.policy={tiny_models['policy']}", "--set", f"model.reward={tiny_models['reward']}",
        "--metrics-out", str(metrics), env={"RLHF_STATE_DIR": str(tmp_path / "state")})
    history = json.loads(metrics.read_text())
    gold = [m["objective/gold_reward"] for m in history]
    assert (gold[-1] + gold[-2]) / 2 - (gold[0] + gold[1]) / 2 >= 0.3, gold
    assert {m["dist/world_size"] for m in history} == {2.0}
    assert history[-1]["episode"] == 12 * (64 if algorithm == "ppo" else 16 * 4)  # every prompt of every rank counted
