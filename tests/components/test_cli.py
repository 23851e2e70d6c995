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


def held_out_quality(directory: Path) -> tuple[float, torch.Tensor]:
    """The policy's LM loss and the reward model's scores on a fixed held-out corpus (seed 999, not trained on)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from models.reward import reward_model_scores
    from models.tasks import sentiment

    tok = AutoTokenizer.from_pretrained(directory / "policy")
    rows = [tok(f"{p} {r}")["input_ids"] + [tok.eos_token_id] for p, r in sentiment.corpus(256, seed=999)]
    ids = torch.full((len(rows), max(map(len, rows))), tok.pad_token_id)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        policy = AutoModelForCausalLM.from_pretrained(directory / "policy").eval()
        loss = float(policy(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss)
        scores = reward_model_scores(AutoModelForSequenceClassification.from_pretrained(directory / "reward").eval(),
                                     ids, lengths)
    return loss, scores


def test_models_tiny_is_reproducible_and_loads_offline(tiny_models, tmp_path):
    """The same seed gives the same data, tokenizer and configs, and models of the same quality. Not bitwise: two
    processes may run GEMM kernels chosen by buffer alignment, and 600 AdamW steps amplify a first 1-ulp difference
    (seen on CI: policy weights 0.17 apart, held-out LM loss 0.8284 vs 0.8276)."""
    out = tmp_path / "tiny"
    proc = run("models", "tiny", "--out", str(out), "--seed", "0")
    info = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert Path(info["paths"]["policy"]).is_dir()
    fixture = Path(tiny_models["policy"]).parent
    for name in ("policy", "reward", "critic", "reward-chars"):
        assert load_file(str(out / name / "model.safetensors")).keys() == \
            load_file(str(fixture / name / "model.safetensors")).keys()
        assert json.loads((out / name / "config.json").read_text()) == json.loads((fixture / name / "config.json").read_text())
        assert (out / name / "tokenizer.json").read_text() == (fixture / name / "tokenizer.json").read_text()
    (ours_loss, ours_scores), (fixture_loss, fixture_scores) = held_out_quality(out), held_out_quality(fixture)
    assert ours_loss == pytest.approx(fixture_loss, abs=0.02) and ours_loss < 1.2  # a trained LM (uniform: ~4.1)
    assert float((ours_scores - fixture_scores).abs().mean()) < 0.02
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

    AutoTokenizer.from_pretrained(out / "policy")
    assert AutoModelForCausalLM.from_pretrained(out / "policy").config.n_layer == 2
    assert AutoModelForSequenceClassification.from_pretrained(out / "reward").config.num_labels == 1
    assert AutoModelForTokenClassification.from_pretrained(out / "critic").config.num_labels == 1
    assert AutoModelForSequenceClassification.from_pretrained(out / "reward-chars").config.num_labels == 1
    chars = AutoTokenizer.from_pretrained(out / "reward-chars")  # its own tokenizer: one token per character
    assert chars.convert_ids_to_tokens(chars("is good")["input_ids"]) == list("is good")


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
