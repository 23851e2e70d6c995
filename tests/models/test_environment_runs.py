"""Environment runs end to end, as `rlhf train` runs them (components/runs.train, MLflow and checkpoints in a temp
state directory), on the tiny chat model: the SFT stage teaches it to call the calculator (the shipped
builtin:arithmetic_sft conversations), then RLOO against the calculator environment (examples/environments/
calculator.py, TRL's protocol) raises its task success; a stalled tool and a raising reward function do not stop a
run; a reasoning-gym task trains and evaluates with pass@k; examples/tools_pipeline.yaml runs sft -> rl -> eval, its
eval stage playing both policies' episodes."""

import itertools
import json
from pathlib import Path

import pytest
import torch

from components.cli.files import load_tree
from components.pipeline.cache import stage_dir
from components.pipeline.config import PipelineFile
from components.pipeline.run import run_pipeline
from components.runs import train
from models.config import preset
from models.tasks import arithmetic
from models.metrics import find
from models.stages.config import SFTRun
from tests.conftest import assert_learned, headroom_closed

pytestmark = pytest.mark.slow(4)  # an SFT stage of 400 steps, a 16-iteration learning run and three short runs
ROOT = Path(__file__).resolve().parents[2]
CALCULATOR = ROOT / "examples" / "environments" / "calculator.py"
ENVS = Path(__file__).parent / "environments.py"
RUNS = itertools.count()
SFT_STEPS = 400  # a whole SFT stage: tiny/chat then copies the numbers on every CPU kernel (docs/environments.md)
TEMPERATURE = 2.0  # the learning check's sampling temperature: at 1.0 the SFT policy leaves no headroom


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("environment-runs")


@pytest.fixture(scope="module")
def sft_model(state_dir) -> str:
    """The tiny chat model after an SFT stage on the calculator conversations, its LR decayed on a cosine: shorter
    stages, or a constant LR, leave the copying of the numbers half-formed in ways that differ with the CPU's kernels
    (measured: docs/environments.md)."""
    run = SFTRun.model_validate({
        "run_name": "sft-calculator", "model": "tiny/chat", "seed": 0,
        "sft": {"data": "builtin:arithmetic_sft", "max_steps": SFT_STEPS, "batch_size": 32, "micro_batch_size": 32,
                "max_eval_rows": 64, "optim": {"lr": 3e-3, "schedule": "cosine"}},
        "deploy": {"state_dir": str(state_dir), "tracking": {"system_metrics": False}}, "checkpoint": {"every": 1000}})
    result = train(run)
    print(f"SFT: held-out loss {result['evals'][0]['eval/loss']:.3f} -> {result['evals'][-1]['eval/loss']:.3f}")
    return result["model_dir"]


def calculator_run(policy: str, state_dir: Path, **overrides):
    base = {"model.policy": policy, "model.dtype": "float32", "algorithm": "rloo", "seed": 0,
            "data.prompts": "builtin:arithmetic", "reward.source": "function",
            "reward.functions": [f"{CALCULATOR}:correct"],
            "environment.factory": f"{CALCULATOR}:Calculator", "environment.max_turns": 2, "environment.workers": 2,
            "generation.max_new_tokens": 64, "generation.temperature": 1.0, "generation.micro_batch_size": 64,
            "reinforce.rollout_batch_size": 16, "reinforce.num_rollouts_per_prompt": 4, "reinforce.minibatch_size": 32,
            "reinforce.epochs": 1, "reinforce.optim.lr": 1e-3, "kl.beta": 0.0, "iterations": 12,
            "deploy.state_dir": str(state_dir), "deploy.tracking.system_metrics": False,
            "run_name": f"calculator-{next(RUNS)}"}
    return preset("none", **{**base, **overrides})


def test_after_the_sft_stage_rl_raises_task_success_with_the_tool(sft_model, state_dir, tmp_path):
    """RLOO on the calculator environment after SFT, sampling at temperature 2 (at 1 the SFT policy answers nearly
    every question right): the share of episodes answered right closes >= 0.3 of its headroom on the training
    questions (the first 64 of builtin:arithmetic, so the first two iterations and the last two each play all of
    them once: one epoch against another, not other questions) and on the held-out eval (64 other questions, 4
    samples each, before and after); the tool is called in most episodes by the end."""
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(row) + "\n" for row in arithmetic.rows(64, seed=0)))
    cfg = calculator_run(sft_model, state_dir, **{
        "iterations": 16, "data.prompts": str(questions), "generation.temperature": TEMPERATURE,
        "reinforce.rollout_batch_size": 32, "reinforce.minibatch_size": 64, "reinforce.epochs": 2,
        "reinforce.optim.lr": 5e-4, "eval.prompts": "builtin:arithmetic", "eval.every": 16, "eval.max_prompts": 64,
        "eval.samples_per_prompt": 4, "eval.temperature": TEMPERATURE})
    result = train(cfg)
    history = result["history"]
    success = [m["rewards/correct/mean"] for m in history]
    tool_use = [m["env/tool_use_ratio"] for m in history]
    closed = assert_learned(success)
    print(f"success {success[0]:.2f}, {success[1]:.2f} -> {success[-2]:.2f}, {success[-1]:.2f} ({closed:.2f} of the "
          f"headroom), tool use {tool_use[0]:.2f} -> {tool_use[-1]:.2f}")
    assert min(tool_use[-2:]) > 0.5 and all(m["tools/call_frequency"] > 0 for m in history)
    assert all(m["env/errors"] == 0 and m["env/timeouts"] == 0 for m in history)
    evals = result["evals"]
    assert [e["iteration"] for e in evals] == [0, 16] and {e["eval/samples"] for e in evals} == {256.0}
    eval_closed = headroom_closed(evals[0]["eval/success"], evals[-1]["eval/success"])
    print(f"held-out success {evals[0]['eval/success']:.2f} -> {evals[-1]['eval/success']:.2f} ({eval_closed:.2f})")
    assert eval_closed >= 0.3
    logged = {name for m in history + evals for name in m}
    assert [name for name in sorted(logged) if find(name, "rl") is None] == []  # all in docs/metrics.md's list
    assert all(0 <= e["eval/success"] <= e["eval/pass_at_2"] <= e["eval/pass_at_4"] <= 1 for e in evals)


def test_a_stalled_tool_and_a_raising_reward_do_not_stop_the_run(sft_model, state_dir):
    """The calculator's tool never returns for a subtraction, and a second reward function raises on a
    multiplication: the run finishes its iterations, and the episodes that met either are counted (env/timeouts,
    env/errors) and scored 0."""
    cfg = calculator_run(sft_model, state_dir, iterations=2, **{
        "environment.factory": f"{ENVS}:StallingCalculator", "environment.call_deadline_s": 3,
        "reward.functions": [f"{CALCULATOR}:correct", f"{ENVS}:raises_on_products"]})
    result = train(cfg)
    history = result["history"]
    assert result["iterations"] == 2 and len(history) == 2
    assert sum(m["env/timeouts"] for m in history) > 0 and sum(m["env/errors"] for m in history) > 0
    print({k: [m[k] for m in history] for k in ("env/timeouts", "env/errors", "reward", "tools/call_frequency")})


def test_a_reasoning_gym_task_trains_and_evaluates_with_pass_at_k(state_dir):
    """reasoning_gym:chain_sum (one-digit sums) as the data, its score_answer as the reward: the run trains, and its
    held-out eval (another seed's questions) reports success and pass@1..4."""
    options = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    cfg = preset("none", **{
        "model.policy": "tiny/chat", "model.dtype": "float32", "algorithm": "rloo", "iterations": 2, "seed": 0,
        "data.prompts": "reasoning_gym:chain_sum", "data.chat_template": True, "data.options": {"size": 200, **options},
        "reward.source": "function", "reward.function": "models.tasks.reasoning:score",
        "eval.prompts": "reasoning_gym:chain_sum", "eval.options": {"size": 16, **options}, "eval.every": 2,
        "eval.samples_per_prompt": 4, "eval.temperature": 1.0, "eval.success_threshold": 1.0,
        "generation.max_new_tokens": 8, "generation.micro_batch_size": 64, "reinforce.rollout_batch_size": 8,
        "reinforce.optim.lr": 1e-3, "deploy.state_dir": str(state_dir), "deploy.tracking.system_metrics": False,
        "run_name": f"reasoning-{next(RUNS)}"})
    result = train(cfg)
    assert result["iterations"] == 2 and [e["iteration"] for e in result["evals"]] == [0, 2]
    for e in result["evals"]:
        assert e["eval/samples"] == 64.0
        assert 0 <= e["eval/pass_at_1"] <= e["eval/pass_at_2"] <= e["eval/pass_at_4"] <= 1
        assert e["eval/pass_at_1"] == pytest.approx(e["eval/success"])
    assert all("objective/gold_reward" in m for m in result["history"])  # the task's scorer is the gold reward


def test_the_tools_pipeline_runs_sft_rl_and_an_eval_that_plays_both_policies_episodes(state_dir):
    """examples/tools_pipeline.yaml as shipped, only shortened: no reward-model stage (its RL stage is scored by a
    function), and the eval stage plays the SFT and the RL policy's held-out episodes with the environment (one
    sampling seed: paired episodes): each policy's success, pass@2 and tool use, the win rate of the pairs and the
    gain in success, checked against a float64 reference from the stage's own rows."""
    given = load_tree(PipelineFile, str(ROOT / "examples" / "tools_pipeline.yaml"), [
        f"deploy.state_dir={state_dir / 'tools-pipeline'}", "deploy.tracking.system_metrics=false",
        "sft.max_steps=20", "rl.iterations=1", "rl.eval.every=0", "rl.reinforce.rollout_batch_size=4",
        "rl.reinforce.minibatch_size=16", "eval.max_prompts=4", "eval.samples_per_prompt=2"])
    summary = run_pipeline(given.pipeline, given.deploy)
    assert list(summary["stages"]) == ["sft", "rl", "eval"]
    record = summary["stages"]["eval"]
    metrics = record["metrics"]
    rows = json.loads((state_dir / "tools-pipeline" / "checkpoints" / stage_dir("eval", record["key"]) / "record.json")
                      .read_text())["rows"]  # the stage's record
    assert len(rows) == 8 and metrics["eval/samples"] == 8.0
    policy = torch.tensor([r["policy_score"] for r in rows], dtype=torch.float64)
    reference = torch.tensor([r["reference_score"] for r in rows], dtype=torch.float64)
    wins = ((policy > reference).double() + 0.5 * (policy == reference).double()).mean()
    assert metrics["eval/win_rate"] == pytest.approx(float(wins), abs=1e-12)
    for prefix, scores in (("eval/", policy), ("eval/reference/", reference)):
        assert metrics[f"{prefix}success"] == pytest.approx(float((scores >= 1.0).double().mean()), abs=1e-12)
        pass_at_2 = float((scores.view(4, 2).max(1).values >= 1.0).double().mean())
        assert metrics[f"{prefix}pass_at_2"] == pytest.approx(pass_at_2, abs=1e-12)
        assert f"{prefix}tools/call_frequency" in metrics and f"{prefix}env/errors" in metrics
    assert metrics["eval/success_gain"] == pytest.approx(metrics["eval/success"] - metrics["eval/reference/success"])
    assert [name for name in metrics if find(name, "eval") is None] == []  # all in docs/metrics.md's list
    assert any("[assistant" in r["policy"] for r in rows) and all(isinstance(r["reference"], str) for r in rows)
