"""The `rlhf` console script as a user runs it (subprocess, offline); refusals before any model loads also through its
entry point (components/cli/main.main) in this process, where no process of its own is what is checked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from components.cli.main import main

pytestmark = pytest.mark.slow(4)

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


QUICK_STEPS = 2  # training steps of each model in a quick build of the tiny models (the default: 600; the chat's 2000)


def quick_rlhf(*args: str) -> list[str]:
    """The `rlhf` console script run in a process of its own, with the tiny models' default training steps cut to
    QUICK_STEPS: a quick build makes the same data, tokenizers, configs and files as the real one, ~15x faster."""
    code = ("import runpy, sys; import models.tiny; "
            "models.tiny.DEFAULT_STEPS = models.tiny.CHAT_STEPS = int(sys.argv[1]); "
            "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    return [sys.executable, "-c", code, str(QUICK_STEPS), RLHF, *args]


def test_models_tiny_is_the_script_that_made_the_shipped_models(tiny_models, tiny_reward_chars, tmp_path):
    """`rlhf models tiny` builds the five models with the shipped ones' data, tokenizers and configs (a quick build:
    QUICK_STEPS steps: the recipe, not its training; what the weights come out as depends on the CPU's kernels, which
    is why the result ships) and records them in its MANIFEST.json; the shipped models themselves are trained (their
    held-out LM loss, against ~4.1 for a uniform guess)."""
    out = tmp_path / "tiny"
    proc = subprocess.run(quick_rlhf("models", "tiny", "--out", str(out), "--seed", "0"), capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"), check=True)
    info = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert info["policy_steps"] == info["reward_steps"] == info["chat_steps"] == QUICK_STEPS
    assert {name: Path(path) for name, path in info["paths"].items()} == \
        {name: out / name for name in ("policy", "reward", "critic", "reward-chars", "chat")}
    shipped = Path(tiny_models["policy"]).parent
    assert Path(tiny_reward_chars) == shipped / "reward-chars"
    manifest = json.loads((out / "MANIFEST.json").read_text())
    for name in ("policy", "reward", "critic", "reward-chars", "chat"):
        assert load_file(str(out / name / "model.safetensors")).keys() == \
            load_file(str(shipped / name / "model.safetensors")).keys()
        config, shipped_config = (json.loads((d / name / "config.json").read_text()) for d in (out, shipped))
        assert {k: v for k, v in config.items() if not k.startswith("_")} == \
            {k: v for k, v in shipped_config.items() if not k.startswith("_")}
        assert (out / name / "tokenizer.json").read_text() == (shipped / name / "tokenizer.json").read_text()
        assert manifest["models"][name]["files"]["model.safetensors"]
    shipped_loss, _ = held_out_quality(shipped)
    assert shipped_loss < 1.2
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification,
                              AutoTokenizer)

    AutoTokenizer.from_pretrained(out / "policy")
    assert AutoModelForCausalLM.from_pretrained(out / "policy").config.n_layer == 2
    assert AutoModelForSequenceClassification.from_pretrained(out / "reward").config.num_labels == 1
    assert AutoModelForTokenClassification.from_pretrained(out / "critic").config.num_labels == 1
    assert AutoModelForSequenceClassification.from_pretrained(out / "reward-chars").config.num_labels == 1
    chars = AutoTokenizer.from_pretrained(out / "reward-chars")  # its own tokenizer: one token per character
    assert chars.convert_ids_to_tokens(chars("is good")["input_ids"]) == list("is good")
    chat = AutoTokenizer.from_pretrained(out / "chat")  # Qwen2.5's chat template and the Qwen2 response template
    assert chat.chat_template == (shipped / "chat" / "chat_template.jinja").read_text()
    assert chat.response_template and chat.eos_token == "<|im_end|>"


def test_config_errors_name_the_field():
    """A bad value exits non-zero naming the field (the console script in a process of its own; the second refusal
    through the same entry point in this process)."""
    proc = run("config", "--set", "ppo.optim.lr=-1", check=False)
    assert proc.returncode != 0 and "lr" in proc.stderr and "greater than 0" in proc.stderr
    with pytest.raises(SystemExit) as refused:
        main(["config", "--set", "reinforce.num_rollouts_per_prompt=1"])
    assert "num_rollouts_per_prompt" in str(refused.value)


def test_a_core_list_of_one_core_given_as_a_number_is_read_as_the_string_vllm_takes():
    """`--set deploy.rollout.cpu_cores=1` reads 1 as a YAML number; the field takes it as the core list '1'."""
    from components.cli.options import parse_overrides
    from models.config import RLHFConfig, merge

    for given in ("1", "2-3", "0,1"):
        overrides = parse_overrides([f"deploy.rollout.cpu_cores={given}"])
        assert merge(RLHFConfig(), overrides).deploy.rollout.cpu_cores == given


def train_in_process(args: list[str], state: Path, capsys) -> tuple[int, str]:
    """`rlhf train` through the console script's entry point in this process (what the script runs): its exit code
    and its stderr. For refusals before any model loads; the exit code and last line of a real process are
    test_a_model_path_that_does_not_exist_fails_fast_naming_the_field's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLHF_STATE_DIR", str(state))
        code = main(["train", *args])
    return code, capsys.readouterr().err


def test_bad_data_fails_the_run_before_any_model_loads(tiny_models, tmp_path, capsys):
    """A data set without the prompt column: `rlhf train` exits naming the file and the columns there are, before the
    actor or a server starts (no rank log, no rollout server)."""
    (tmp_path / "rows.jsonl").write_text(json.dumps({"question": "review the cat :", "answer": 1}) + "\n")
    code, err = train_in_process(["--preset", "tiny", "--set", f"data.prompts={tmp_path / 'rows.jsonl'}", "--set",
                                  f"model.policy={tiny_models['policy']}", "--set",
                                  f"model.reward={tiny_models['reward']}"],
                                 tmp_path / "state", capsys)
    assert code != 0
    assert f"data.prompts: '{tmp_path / 'rows.jsonl'}' has no column 'prompt' (the prompt_key); its columns: " \
           "['question', 'answer']" in err, err[-2000:]
    assert not (tmp_path / "state" / "runs").exists()  # nothing of a run was opened


def test_an_eval_set_smaller_than_the_actor_ranks_is_refused_before_any_model_loads(tiny_models, tmp_path, capsys):
    """Every actor rank evaluates its share of eval.prompts: with 2 ranks and 1 eval prompt, `rlhf train` exits naming
    eval.prompts when the data is read, before any rank starts (it used to die on rank 1 with 'max() arg is an empty
    sequence' and leave rank 0 waiting in the next collective)."""
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "review the cat :"}) + "\n")
    code, err = train_in_process(["--preset", "tiny", "--set", "deploy.actor.nproc_per_node=2",
                                  "--set", f"eval.prompts={tmp_path / 'eval.jsonl'}",
                                  "--set", "eval.every=2", "--set", f"model.policy={tiny_models['policy']}",
                                  "--set", f"model.reward={tiny_models['reward']}"], tmp_path / "state", capsys)
    assert code != 0
    assert f"eval.prompts: '{tmp_path / 'eval.jsonl'}' has 1 prompt(s) (split 'test') for 2 actor ranks: every rank " \
           "needs at least one" in err, err[-2000:]
    assert not (tmp_path / "state" / "runs").exists()  # no run opened, no rank started


def test_rlhf_train_checkpoints_logs_to_mlflow_and_resumes_by_run_name_beside_a_run_started_with_it(tmp_path):
    """`rlhf train` is a run like a flow run's (the one run builder): on an empty state directory (the embedded
    models ship with the package: nothing is built), `--set run_name=X --set iterations=2` checkpoints and logs to the
    state directory's MLflow store; the same command with iterations=4 resumes at iteration 3 (nothing redone), and
    MLflow holds one run X with the metrics of iterations 1 to 4; the summary names the run and its checkpoint.
    The first run starts together with another one (another name) on the new state directory: they share its MLflow
    store, create its tables once (a lock while a sqlite store is first used) and both complete, each its own run."""
    from mlflow.tracking import MlflowClient

    state = tmp_path / "state"
    env = {"RLHF_STATE_DIR": str(state)}
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", **env)
    common = ["--preset", "tiny", "--set", "algorithm=rloo", "--set", "run_name=cli-resume",
              "--set", "deploy.tracking.system_metrics=false"]
    together = [[*common, "--set", "iterations=2", "--metrics-out", str(tmp_path / "m1.json")],
                ["--preset", "tiny", "--set", "algorithm=rloo", "--set", "iterations=1", "--set", "run_name=beside",
                 "--set", "reinforce.rollout_batch_size=4", "--set", "generation.max_new_tokens=4",
                 "--set", "deploy.tracking.system_metrics=false"]]
    procs = [subprocess.Popen([RLHF, "train", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=full_env) for args in together]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [out[-2000:] for out in outputs]
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rlhf-flows").experiment_id
    started = client.search_runs([experiment])
    assert sorted(r.info.run_name for r in started) == ["beside", "cli-resume"], "both runs started together logged"
    assert all(r.info.status == "FINISHED" for r in started)
    assert "iteration 2/2" in outputs[0] and "new run" in outputs[0]
    assert json.loads((state / "checkpoints" / "cli-resume" / "latest.json").read_text())["iteration"] == 2
    summary = tmp_path / "summary.json"
    second = run("train", *common, "--set", "iterations=4", "--summary-out", str(summary), env=env)
    assert "resuming from checkpoint iteration 2" in second.stdout
    printed = [line.split(":")[0] for line in second.stdout.splitlines() if line.startswith("iteration ")]
    assert printed == ["iteration 3/4", "iteration 4/4"], second.stdout[-2000:]
    result = json.loads(summary.read_text())
    assert (result["run_name"], result["iterations"], len(result["history"])) == ("cli-resume", 4, 2)
    assert result["checkpoint"] == (state / "checkpoints" / "cli-resume").as_uri()
    assert json.loads((state / "checkpoints" / "cli-resume" / "latest.json").read_text())["iteration"] == 4
    runs = client.search_runs([experiment], filter_string="attributes.run_name = 'cli-resume'")
    assert len(runs) == 1 and runs[0].info.run_id == result["mlflow_run_id"] and runs[0].info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "objective/kl"))
    assert steps == [1, 2, 3, 4]
    assert json.loads((tmp_path / "m1.json").read_text())[1]["episode"] == 2 * 16 * 4
    assert not (state / "models").exists()  # nothing built: the embedded models ship with the package


def test_rlhf_train_alone_runs_the_tiny_preset_and_a_config_given_names_its_own(monkeypatch, capsys):
    """`rlhf train` with no config at all is the embedded demo, named (--preset tiny); anything given (--set, a file)
    runs over the preset it names, none when it names none, never one its model implies; its critic and reward
    model in this process (the in_process placement) unless another placement is named."""
    from components.cli import commands

    ran = []
    monkeypatch.setattr(commands, "train", lambda cfg, steps: ran.append(cfg) or {"history": []})
    for args in ([], ["--set", "iterations=2"], ["--preset", "tiny", "--placement", "local"]):
        assert main(["train", *args]) == 0
    assert [(c.preset, c.model.policy, c.deploy.placement, c.deploy.critic.launch) for c in ran] == [
        ("tiny", "tiny/policy", "in_process", "in_process"), ("none", "tiny/policy", "in_process", "in_process"),
        ("tiny", "tiny/policy", "local", "local")]
    assert "no config given: the embedded demo on the tiny models (--preset tiny)" in capsys.readouterr().out


def test_a_model_path_that_does_not_exist_fails_fast_naming_the_field(tmp_path):
    proc = run("train", "--preset", "tiny", "--set", f"model.policy={tmp_path / 'no-such-model'}", "--set",
               "iterations=1",
               env={"RLHF_STATE_DIR": str(tmp_path / "state")}, check=False)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rlhf train failed: FileNotFoundError: model.policy: model path") and "no-such-model" in last
    assert not (tmp_path / "state" / "runs").exists()  # refused before the run opened
