"""The `rlhf` console script as a user runs it (subprocess, offline)."""

import json
import os
import subprocess
import sys
from pathlib import Path

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
