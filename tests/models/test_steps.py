"""PPO and RLOO through the run builder (components/runs.py) with the critic and reward model in process, as `rlhf
train` runs them: they learn the shipped task, are deterministic, and refuse bad input up front."""

import itertools

import pytest
import torch

from components.runs import train
from models.algorithms import resolve
from models.config import preset, with_schedule_lengths
from models.resolve import pin
from models.eval import Judged, compared, eval_metrics
from models.loop import build_actor, build_local_reward
from models.metrics import find
from tests.conftest import assert_learned, headroom_closed

NON_DETERMINISTIC = ("time/", "throughput/", "step_time")
pytestmark = pytest.mark.slow(5)  # ~5 min of learning runs: started first, beside tests/flows/test_deployments.py
RUNS = itertools.count()


def tiny_cfg(tiny_models, tmp_path, **overrides):
    """A run of the embedded default in this process (critic and reward model in process, as `rlhf train`), its own
    name, the module's state directory; what it reads pinned, as a job pins it (models/resolve.py)."""
    base = {"deploy.state_dir": str(tmp_path), "model.policy": tiny_models["policy"],
            "model.reward": tiny_models["reward"],
            "deploy.critic.launch": "in_process", "deploy.reward.launch": "in_process",
            "deploy.tracking.system_metrics": False, "run_name": f"steps-{next(RUNS)}"}
    return pin(preset("tiny", **{**base, **overrides}))


def train_in_process(cfg, on_eval=None) -> list[dict]:
    """The run's metrics per iteration (its evals to `on_eval(iteration, metrics)`)."""
    result = train(cfg)
    for evaluation in result["evals"]:
        on_eval and on_eval(evaluation["iteration"], {k: v for k, v in evaluation.items() if k != "iteration"})
    return result["history"]


@pytest.mark.parametrize("algorithm", ["ppo", "rloo", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "reinforce_pp"])
def test_learns_the_shipped_task(tiny_models, tmp_path, algorithm):
    """Every recipe (models/algorithms/recipes.py) as `--set algorithm=<recipe>` runs it: the mean gold reward over the
    last 2 iterations closes >= 0.3 of the headroom left after the first 2 (tests/conftest.assert_learned says why
    0.3; every recipe's figures over seeds and kernel sets: benchmarks/recipes.py). With a KL coefficient the KL to
    the reference is reported and positive once the policy moved; without one (beta 0) no reference pass runs and no
    KL is logged."""
    cfg = tiny_cfg(tiny_models, tmp_path, algorithm=algorithm, iterations=12, seed=0)
    history = train_in_process(cfg)
    gold = [m["objective/gold_reward"] for m in history]
    closed = assert_learned(gold)
    print(f"{algorithm}: gold {gold[0]:+.3f} -> {gold[-1]:+.3f} ({closed:.2f} of the headroom closed)")
    assert all("time/generate" in m for m in history)
    if resolve(cfg).kl_beta > 0:
        assert history[-1]["objective/kl"] > 0.05 and all("time/reference" in m for m in history)
    else:
        assert not any("objective/kl" in m or "time/reference" in m for m in history)


def test_on_policy_distillation_closes_half_the_gap_to_a_teacher_trained_by_rl(tiny_models, tmp_path):
    """algorithm=opd: a teacher trained by RLOO on the shipped task (12 iterations), then the shipped policy distilled
    from it on its own samples for 12 iterations: its held-out gold reward (40 prompts x 4 samples at temperature 1)
    closes >= 0.5 of the gap between its start and the teacher's, and its reverse KL to the teacher falls. (Measured:
    0.84-1.0 of the gap over seeds, benchmarks/recipes.py.) The teacher's logprobs come from the in-process reward
    backend here, from the reward server's teacher_logprobs in a served run (tests/components/serving/
    test_servers.py checks that model against this one)."""
    held_out = {"eval.prompts": "builtin:sentiment", "eval.every": 12, "eval.temperature": 1.0,
                "eval.samples_per_prompt": 4}
    teacher = train(tiny_cfg(tiny_models, tmp_path, algorithm="rloo", iterations=12, seed=100, **held_out))
    student = train(tiny_cfg(tiny_models, tmp_path, algorithm="opd", iterations=12, seed=0, **held_out,
                             **{"model.teacher": teacher["model_dir"]}))
    target = teacher["evals"][-1]["eval/gold_reward"]
    start, end = student["evals"][0]["eval/gold_reward"], student["evals"][-1]["eval/gold_reward"]
    assert target - start > 0.3, (start, target)  # the teacher learned: there is a gap to close
    assert (end - start) / (target - start) >= 0.5, (start, end, target)
    kl = [m["opd/reverse_kl"] for m in student["history"]]
    assert sum(kl[-2:]) / 2 < 0.5 * sum(kl[:2]) / 2, kl


@pytest.mark.parametrize("algorithm", ["ppo", "rloo"])
def test_learns_from_a_reward_model_of_another_tokenizer(tiny_models, tiny_reward_chars, tmp_path, algorithm):
    """model.reward=reward-chars (characters, not the policy's words): rewards go as text (for PPO, through the
    critic's resident reward model; the critic is tiny/critic, which reads the policy's tokens), the scores are
    reward-chars' own, and both algorithms learn by the margin of test_learns_the_shipped_task. RLOO's 12-iteration run
    through reward-chars is made once, by tests/flows/test_deployments.py (the same config and seed, scored by a reward
    server), which asserts its learning and its scores; here RLOO runs 2 iterations in process, for the in-process text
    path."""
    iterations = 12 if algorithm == "ppo" else 2
    cfg = tiny_cfg(tiny_models, tmp_path, algorithm=algorithm, iterations=iterations, seed=0,
                   **{"model.reward": tiny_reward_chars, "model.critic": tiny_models["critic"]})
    history = train_in_process(cfg)
    gold = [m["objective/gold_reward"] for m in history]
    scores = [m["reward"] for m in history]
    assert len(history) == iterations
    if iterations == 12:
        assert_learned(gold)
    assert max(abs(s - g) for s, g in zip(scores, gold)) < 0.1, (scores, gold)  # the scores are reward-chars' own


@pytest.mark.parametrize("algorithm", ["ppo", "rloo"])
def test_same_seed_same_first_iteration(tiny_models, tmp_path, algorithm):
    """The same seed gives the same first iteration, another seed another one; PPO and RLOO log the same names for
    the same quantities (TRL's), PPO its critic's besides."""
    runs = [train_in_process(tiny_cfg(tiny_models, tmp_path, algorithm=algorithm, iterations=1, seed=7))[0]
            for _ in range(2)]
    other = train_in_process(tiny_cfg(tiny_models, tmp_path, algorithm=algorithm, iterations=1, seed=8))[0]
    keys = [k for k in runs[0] if not k.startswith(NON_DETERMINISTIC)]
    assert {k: runs[0][k] for k in keys} == {k: runs[1][k] for k in keys}
    assert runs[0]["reward"] != other["reward"]
    shared = {"objective/kl", "objective/entropy", "reward", "objective/gold_reward", "objective/rlhf_reward",
              "objective/non_score_reward", "policy/approxkl_avg", "entropy", "loss",
              "completions/clipped_ratio", "completions/mean_length", "learning_rate", "episode", "time/generate",
              "time/reference",
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
    with pytest.raises(FileNotFoundError, match="^model.policy: model path '.*nope' does not exist"):
        tiny_cfg(tiny_models, tmp_path, **{"model.policy": str(tmp_path / "nope")})  # pinned before anything loads


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
    RLOO learns it in 12 iterations, the held-out eval (other prompts: the `test` split, 4 samples each at temperature
    1: greedy decoding of the shipped policy already scores ~0.95) runs at 0, 4, 8 and 12 with its metrics, rises,
    and the training curve is the same as without the eval, number for number (same process, same kernels, same
    data: the eval samples from a generator of its own): the run without it is the first 5 iterations of the same
    run (its LR schedule the 12 iterations' one), past the evals at 0 and 4.

    Why 0.3 of the headroom (the training curve): with p ~0.35 a 0/1 reward has std ~0.48; a mean over 2 iterations
    of 64 samples has a standard error of ~0.04, the difference of two such means ~0.06; from ~0.37 a third of the
    headroom is ~0.2, > 3 of them. The eval's 160 samples: a standard error of ~0.04 each, so 0.2 of its headroom
    (~0.14 from ~0.3) is > 2.5 of the difference's. (Seen here, shipped models, seed 0: training 0.52 of the
    headroom, the eval 0.31 -> 0.68, 0.53 of it.)"""
    task = {"algorithm": "rloo", "iterations": 12, "seed": 0, "data.prompts": "builtin:sentiment_target",
            "reward.source": "function", "reward.function": TARGETED, "reward.gold": TARGETED}
    evals = []
    with_eval = train_in_process(tiny_cfg(tiny_models, tmp_path, **task, **{
        "eval.prompts": "builtin:sentiment_target", "eval.every": 4, "eval.temperature": 1.0,
        "eval.samples_per_prompt": 4}), on_eval=lambda i, m: evals.append((i, m)))
    schedule = with_schedule_lengths(tiny_cfg(tiny_models, tmp_path, **task)).reinforce.optim.total_steps
    without = train_in_process(tiny_cfg(tiny_models, tmp_path, **{**task, "iterations": 5},
                                        **{"reinforce.optim.total_steps": schedule}))
    keys = [k for k in without[0] if not k.startswith(NON_DETERMINISTIC)]
    assert len(without) == 5 and len(with_eval) == 12
    assert [{k: m[k] for k in keys} for m in with_eval[:5]] == [{k: m[k] for k in keys} for m in without]
    assert_learned([m["objective/gold_reward"] for m in with_eval])
    assert [i for i, _ in evals] == [0, 4, 8, 12]
    first, last = evals[0][1], evals[-1][1]
    assert {"eval/reward", "eval/gold_reward", "eval/completions/mean_length", "eval/accuracy",
            "eval/pass_at_4"} <= set(first)
    assert first["eval/samples"] == 160  # the test split: 40 held-out prompts x 4 samples
    assert headroom_closed(first["eval/gold_reward"], last["eval/gold_reward"]) >= 0.2, evals
    assert first["eval/accuracy"] == first["eval/reward"] <= first["eval/pass_at_4"]  # 0/1 samples, any of 4 passes


def test_eval_metrics_against_a_float64_reference():
    scores = [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1]  # 3 prompts x k=4 samples, consecutive
    gold = [0.5, -1, 0, 0, 0, 0, 0.25, 0, 1, 1, 0, 1]
    lengths = [3, 4, 5, 6, 1, 1, 1, 1, 2, 2, 2, 2]
    m = eval_metrics(torch.tensor(scores, dtype=torch.float64), torch.tensor(gold, dtype=torch.float64),
                     torch.tensor(lengths, dtype=torch.float64), k=4)
    passed = sum(any(scores[i * 4:(i + 1) * 4]) for i in range(3)) / 3
    assert m["eval/pass_at_4"] == pytest.approx(passed) == pytest.approx(2 / 3)
    assert m["eval/accuracy"] == pytest.approx(sum(scores) / 12)
    assert m["eval/gold_reward"] == pytest.approx(sum(gold) / 12)
    assert m["eval/completions/mean_length"] == pytest.approx(30 / 12)
    continuous = eval_metrics(torch.tensor([0.5, 1.0]), None, torch.tensor([1.0, 2.0]), k=1)
    assert "eval/accuracy" not in continuous and "eval/gold_reward" not in continuous  # not a 0/1 reward, no gold


def test_a_policy_against_a_reference_by_one_scheme_against_a_float64_reference():
    """The eval job's comparison (models/eval.compared, both of its judges): the policy's held-out metrics by the RL
    eval's names, the reference's under eval/reference/, win rates of the paired samples (a tie one half), the gain
    in success; every name in the list docs/metrics.md is generated from."""
    scores, reference = [1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]  # 2 prompts x k=2, the j-th samples paired
    gold, reference_gold = [0.5, 0.25, 0.0, 1.0], [0.5, 0.0, 0.5, 0.0]

    def judged(s, g):
        s, g = torch.tensor(s, dtype=torch.float64), torch.tensor(g, dtype=torch.float64)
        rows = [{"prompt": f"p{i // 2}", "response": f"r{i}", "score": float(a), "gold_reward": float(b)}
                for i, (a, b) in enumerate(zip(s, g))]
        return Judged(s, g, eval_metrics(s, g, torch.ones(4), k=2), rows)

    metrics, rows = compared(judged(scores, gold), judged(reference, reference_gold), limit=3)
    assert metrics["eval/reward"] == pytest.approx(sum(scores) / 4)
    assert metrics["eval/reference/reward"] == pytest.approx(sum(reference) / 4)
    assert metrics["eval/reference/gold_reward"] == pytest.approx(sum(reference_gold) / 4)
    assert metrics["eval/win_rate"] == pytest.approx((1 + 0.5 + 0.5 + 1) / 4)
    assert metrics["eval/gold_win_rate"] == pytest.approx((0.5 + 1 + 0 + 1) / 4)
    assert metrics["eval/success_gain"] == pytest.approx(3 / 4 - 1 / 4)
    assert [name for name in metrics if find(name, "eval") is None] == []
    assert len(rows) == 3 and rows[1] == {"prompt": "p0", "policy": "r1", "policy_score": 0.0,
                                          "policy_gold_reward": 0.25, "reference": "r1", "reference_score": 0.0,
                                          "reference_gold_reward": 0.0}


def test_dapo_s_dynamic_sampling_resumes_bit_for_bit_and_trains_on_informative_groups(tiny_models, tmp_path):
    """DAPO on a 0/1 reward (builtin:sentiment_target): groups whose 4 samples all score alike are dropped and more
    prompts are sampled; 2 iterations, then the same run name resumed to 4, equal 4 iterations straight, bit for bit
    (every metric but timings, every exported weight file's sha256): the checkpoint keeps the stream after the last
    batch each step used."""
    task = {"algorithm": "dapo", "seed": 3, "data.prompts": "builtin:sentiment_target", "reward.source": "function",
            "reward.function": TARGETED, "reward.gold": TARGETED, "checkpoint.every": 2}
    straight = train(tiny_cfg(tiny_models, tmp_path, **task, iterations=4, run_name="dapo-straight"))
    train(tiny_cfg(tiny_models, tmp_path, **task, iterations=2, run_name="dapo-resumed"))
    resumed = train(tiny_cfg(tiny_models, tmp_path, **task, iterations=4, run_name="dapo-resumed"))
    history = straight["history"]
    assert [m["iteration"] for m in resumed["history"]] == [3.0, 4.0]
    keys = [k for k in history[0] if not k.startswith(NON_DETERMINISTIC)]
    assert [{k: m[k] for k in keys} for m in history[2:]] == [{k: m[k] for k in keys} for m in resumed["history"]]
    assert straight["files"] == resumed["files"] and straight["files"]
    assert max(m["dynamic_sampling/rounds"] for m in history) >= 2  # groups were dropped, more prompts sampled
    for m in history:  # the batch holds only informative groups unless the rounds ran out
        assert m["frac_reward_zero_std"] == pytest.approx(m["dynamic_sampling/filled_groups"] / 16)
        assert m["dynamic_sampling/kept_groups"] + m["dynamic_sampling/filled_groups"] == 16
