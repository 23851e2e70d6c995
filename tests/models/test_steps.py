"""In-process PPO and RLOO: they learn the shipped task, are deterministic, and refuse bad input up front."""

import pytest
import torch

from models.config import preset
from models.eval import eval_metrics
from models.loop import build_actor, build_local_reward, train_in_process

NON_DETERMINISTIC = ("time/", "throughput/", "step_time")
pytestmark = pytest.mark.slow  # ~4 min of learning runs: started first, beside tests/flows/test_deployments.py


def tiny_cfg(tiny_models, tmp_path, **overrides):
    base = {"deploy.state_dir": str(tmp_path), "model.policy": tiny_models["policy"], "model.reward": tiny_models["reward"]}
    return preset("tiny", **{**base, **overrides})


def mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.parametrize("algorithm", ["ppo", "rloo"])
def test_learns_the_shipped_task(tiny_models, tmp_path, algorithm):
    """Mean gold reward over the last 2 iterations beats the first 2 by >= 0.3.

    Why 0.3: the gold reward has std ~0.75 at the start; a mean over 2 iterations of 64 rollouts has a standard error
    of ~0.07, so the difference of two such means has ~0.09: 0.3 is > 3 standard errors above noise. (Seen here:
    +0.6 to +0.8 after 12 iterations.) The KL to the reference must be reported and positive once the policy moved.
    """
    cfg = tiny_cfg(tiny_models, tmp_path, algorithm=algorithm, iterations=12, seed=0)
    history = train_in_process(cfg)
    gold = [m["objective/gold_reward"] for m in history]
    gain = mean(gold[-2:]) - mean(gold[:2])
    print(f"{algorithm}: gold {gold[0]:+.3f} -> {gold[-1]:+.3f} (gain {gain:+.3f}), final KL {history[-1]['objective/kl']:.3f}")
    assert gain >= 0.3, gold
    assert history[-1]["objective/kl"] > 0.05
    assert all("objective/kl" in m and "time/generate" in m for m in history)


@pytest.mark.parametrize("algorithm", ["ppo", "rloo"])
def test_learns_from_a_reward_model_of_another_tokenizer(tiny_models, tiny_reward_chars, tmp_path, algorithm):
    """model.reward=reward-chars (characters, not the policy's words): rewards go as text (for PPO, through the
    critic's resident reward model; the critic is tiny/critic, which reads the policy's tokens), the scores are
    reward-chars' own, and both algorithms learn by the margin of test_learns_the_shipped_task. (Seen here: +0.63 for
    PPO, +0.52 for RLOO after 12 iterations.) RLOO's 12-iteration run through reward-chars is made once, by
    tests/flows/test_deployments.py (the same config and seed, scored by a reward server), which asserts its learning
    and its scores; here RLOO runs 2 iterations in process, for the in-process text path."""
    iterations = 12 if algorithm == "ppo" else 2
    cfg = tiny_cfg(tiny_models, tmp_path, algorithm=algorithm, iterations=iterations, seed=0,
                   **{"model.reward": tiny_reward_chars, "model.critic": tiny_models["critic"]})
    history = train_in_process(cfg)
    gold = [m["objective/gold_reward"] for m in history]
    scores = [m["reward"] for m in history]
    assert len(history) == iterations
    if iterations == 12:
        assert mean(gold[-2:]) - mean(gold[:2]) >= 0.3, gold
    assert max(abs(s - g) for s, g in zip(scores, gold)) < 0.1, (scores, gold)  # the scores are reward-chars' own


@pytest.mark.parametrize("algorithm", ["ppo", "rloo"])
def test_same_seed_same_first_iteration(tiny_models, tmp_path, algorithm):
    """The same seed gives the same first iteration, another seed another one; PPO and RLOO log the same names for
    the same quantities (TRL's), PPO its critic's besides."""
    runs = [train_in_process(tiny_cfg(tiny_models, tmp_path, algorithm=algorithm, iterations=1, seed=7))[0] for _ in range(2)]
    other = train_in_process(tiny_cfg(tiny_models, tmp_path, algorithm=algorithm, iterations=1, seed=8))[0]
    keys = [k for k in runs[0] if not k.startswith(NON_DETERMINISTIC)]
    assert {k: runs[0][k] for k in keys} == {k: runs[1][k] for k in keys}
    assert runs[0]["reward"] != other["reward"]
    shared = {"objective/kl", "objective/entropy", "reward", "objective/gold_reward", "objective/rlhf_reward",
              "objective/non_score_reward", "policy/approxkl_avg", "entropy", "loss",
              "completions/clipped_ratio", "completions/mean_length", "learning_rate", "episode", "time/generate", "time/reference",
              "time/train", "step_time"}
    assert shared <= set(runs[0])
    if algorithm == "ppo":
        assert {"loss/value_avg", "clip_ratio/region_mean", "val/clipfrac_avg", "time/critic_wait"} <= set(runs[0])


def test_lora_ppo_runs_with_adapter_reference(tiny_models, tmp_path):
    cfg = tiny_cfg(tiny_models, tmp_path, algorithm="ppo", iterations=2,
                   **{"model.lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["c_attn"]}})
    history = train_in_process(cfg)
    assert history[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # LoRA B starts at 0: actor == reference
    assert history[1]["objective/kl"] != 0.0


def test_function_reward_rloo(tiny_models, tmp_path):
    cfg = tiny_cfg(tiny_models, tmp_path, algorithm="rloo", iterations=1,
                   **{"reward.source": "function", "reward.function": "tests.models.bad_rewards:length_reward"})
    m = train_in_process(cfg)[0]
    assert m["reward"] == pytest.approx(m["completions/mean_length"] - 1, abs=1.0)


@pytest.mark.parametrize("overrides,message", [
    ({"ppo.optim.lr": -1.0}, "lr"),
    ({"reinforce.num_rollouts_per_prompt": 1}, "num_rollouts_per_prompt"),
    ({"reward.source": "function"}, "reward.function is required"),
    ({"reward.function": "no colon here"}, "package.module:function"),
    ({"generation.temperature": 0}, "temperature"),
    ({"ppo.not_a_field": 1}, "not_a_field"),
])
def test_invalid_config_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        preset("tiny", **overrides)


@pytest.mark.parametrize("spec,message", [
    ("tests.models.nowhere:fn", "cannot import"),
    ("tests.models.bad_rewards:missing", "cannot import"),
    ("tests.models.bad_rewards:not_callable", "not callable"),
    ("tests.models.bad_rewards:wrong_length", "returned 1 rewards for 2 responses"),
    ("tests.models.bad_rewards:nan_reward", "non-finite"),
])
def test_bad_reward_function_fails_before_training(tiny_models, tmp_path, spec, message):
    cfg = tiny_cfg(tiny_models, tmp_path, algorithm="rloo", **{"reward.source": "function", "reward.function": spec})
    with pytest.raises(ValueError, match=message) as info:
        build_local_reward(cfg)
    assert "reward.function" in str(info.value)


def test_missing_model_path_fails_before_training(tiny_models, tmp_path):
    cfg = tiny_cfg(tiny_models, tmp_path, **{"model.policy": str(tmp_path / "nope")})
    with pytest.raises(FileNotFoundError, match="model.policy"):
        build_actor(cfg)


def test_bfloat16_compute_keeps_float32_master_weights(tiny_models, tmp_path):
    """dtype=bfloat16 is the compute dtype (autocast): trainable weights and AdamW states stay float32."""
    cfg = tiny_cfg(tiny_models, tmp_path, algorithm="rloo", iterations=2, **{"model.dtype": "bfloat16"})
    state = build_actor(cfg)
    assert all(p.dtype == torch.float32 for p in state.policy.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in state.policy.reference.parameters())
    history = train_in_process(cfg)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in history)
    assert history[1]["objective/kl"] != 0.0  # the float32 weights moved


def test_chat_template_prompts(tiny_models):
    """data.chat_template wraps a plain prompt as a user turn of the policy's template: a template that changes the
    text (a word before the turn, a generation prompt after it) changes the ids, exactly as the rendered text."""
    from models.policy import Policy

    policy = Policy.load(tiny_models["policy"])
    policy.tokenizer.chat_template = ("{% for m in messages %}review {{ m['content'] }}{% endfor %}"
                                      "{% if add_generation_prompt %} :{% endif %}")
    ids = policy.encode_prompts(["the cat"], chat_template=True)
    plain = policy.encode_prompts(["the cat"])
    rendered = policy.tokenizer("review the cat :", add_special_tokens=False)["input_ids"]
    assert policy.tokenizer.unk_token_id not in rendered
    assert ids == [rendered] and ids != plain and len(ids[0]) > len(plain[0])
    assert all(isinstance(i, int) for i in ids[0])


TARGETED = "models.tasks.sentiment:targeted_reward"


def test_a_reward_reading_a_column_learns_and_the_held_out_eval_rises_without_changing_training(tiny_models, tmp_path):
    """builtin:sentiment_target: the reward (a 0/1 verifiable reward, the gold one too) reads the `target` column.
    RLOO learns it in 12 iterations, the held-out eval (other prompts: the `test` split) runs at 0, 4, 8 and 12 with
    its metrics, rises, and the training curve is the same as without the eval, number for number (same process,
    same kernels, same data: the eval samples from a generator of its own).

    Why a gain >= 0.2: with p ~0.35 a 0/1 reward has std ~0.48; a mean over 2 iterations of 64 samples has a standard
    error of ~0.04, the difference of two such means ~0.06: 0.2 is > 3 of them. (Seen here: +0.30 at seed 0, +0.38 at
    seed 1; the greedy eval 0.70 -> 1.00.)"""
    task = {"algorithm": "rloo", "iterations": 12, "seed": 0, "data.prompts": "builtin:sentiment_target",
            "reward.source": "function", "reward.function": TARGETED, "reward.gold": TARGETED}
    evals = []
    with_eval = train_in_process(tiny_cfg(tiny_models, tmp_path, **task, **{
        "eval.prompts": "builtin:sentiment_target", "eval.every": 4}), on_eval=lambda i, m: evals.append((i, m)))
    without = train_in_process(tiny_cfg(tiny_models, tmp_path, **task))
    keys = [k for k in without[0] if not k.startswith(NON_DETERMINISTIC)]
    assert [{k: m[k] for k in keys} for m in with_eval] == [{k: m[k] for k in keys} for m in without]
    gold = [m["objective/gold_reward"] for m in with_eval]
    assert mean(gold[-2:]) - mean(gold[:2]) >= 0.2, gold
    assert [i for i, _ in evals] == [0, 4, 8, 12]
    first, last = evals[0][1], evals[-1][1]
    assert {"eval/reward", "eval/gold_reward", "eval/completions/mean_length", "eval/accuracy", "eval/pass_at_1"} <= set(first)
    assert first["eval/samples"] == 40  # the test split: 40 held-out prompts x 1 greedy sample
    assert last["eval/gold_reward"] - first["eval/gold_reward"] >= 0.2, evals
    assert first["eval/accuracy"] == first["eval/reward"] == first["eval/pass_at_1"]  # one 0/1 sample per prompt


def test_eval_metrics_against_a_float64_reference():
    scores = [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1]  # 3 prompts x k=4 samples, consecutive
    gold = [0.5, -1, 0, 0, 0, 0, 0.25, 0, 1, 1, 0, 1]
    lengths = [3, 4, 5, 6, 1, 1, 1, 1, 2, 2, 2, 2]
    m = eval_metrics(torch.tensor(scores, dtype=torch.float64), torch.tensor(gold, dtype=torch.float64),
                     torch.tensor(lengths, dtype=torch.float64), k=4)
    passed = sum(any(scores[i * 4:(i + 1) * 4]) for i in range(3)) / 3
    assert m["eval/pass_at_4"] == pytest.approx(passed) == pytest.approx(2 / 3)
    assert m["eval/accuracy"] == pytest.approx(sum(scores) / 12)
    assert m["eval/gold_reward"] == pytest.approx(sum(gold) / 12) and m["eval/completions/mean_length"] == pytest.approx(30 / 12)
    continuous = eval_metrics(torch.tensor([0.5, 1.0]), None, torch.tensor([1.0, 2.0]), k=1)
    assert "eval/accuracy" not in continuous and "eval/gold_reward" not in continuous  # not a 0/1 reward, no gold
