"""Defaults on a user's model: the field defaults fit a real model, the tiny model's settings are the tiny preset's,
chosen by the policy; what a config sets is kept; the gold reward is the shipped task's only on the shipped task;
`rlhf config --describe` prints every field with its description."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from pydantic import BaseModel

from components.cli.main import main
from models.config import RLHFConfig, RunConfig, from_layers, load_config, preset
from models.loop import gold_spec
from models.tiny_files import EMBEDDED_DIR

TINY_LR = 3e-4


def test_the_tiny_preset_comes_with_the_tiny_policy_and_a_user_policy_gets_the_field_defaults():
    tiny = load_config()
    assert (tiny.model.policy, tiny.model.reward, tiny.model.dtype) == ("tiny/policy", "tiny/reward", "float32")
    assert tiny.reinforce.optim.lr == tiny.ppo.optim.lr == TINY_LR and tiny.critic.optim.lr == 1e-3
    assert tiny.generation.max_new_tokens == 16 and tiny.data.prompts == "builtin:sentiment"
    # the shipped directory itself is the tiny policy too (what the tests' fixtures name)
    assert load_config(overrides={"model.policy": str(EMBEDDED_DIR / "policy")}).reinforce.optim.lr == TINY_LR

    user = load_config(overrides={"model.policy": "Qwen/Qwen2.5-0.5B-Instruct"})
    assert (user.model.reward, user.model.critic, user.data.prompts) == (None, None, None)
    assert user.reinforce.optim.lr == user.ppo.optim.lr == 1e-6 and user.critic.optim.lr == 1e-5
    assert (user.model.dtype, user.generation.max_new_tokens, user.generation.micro_batch_size) == ("bfloat16", 256, 8)
    assert user.reward.gold is None

    # an explicit preset wins; what the config sets is kept under either
    assert load_config(preset_name="tiny", overrides={"model.policy": "org/x"}).reinforce.optim.lr == TINY_LR
    kept = load_config(overrides={"reinforce.optim.lr": 5e-5, "generation.max_new_tokens": 7})
    assert (kept.reinforce.optim.lr, kept.generation.max_new_tokens, kept.ppo.optim.lr) == (5e-5, 7, TINY_LR)
    with pytest.raises(ValueError, match="unknown preset 'big'"):
        preset("big")


def test_a_partial_flow_config_gets_the_preset_of_its_policy(tmp_path):
    """A flow run's parameters (nested, partial) and a RunConfig of what was given: the same rule as the CLI."""
    given = from_layers({"algorithm": "rloo", "iterations": 3}, {"deploy": {"state_dir": str(tmp_path)}})
    assert given.reinforce.optim.lr == TINY_LR and given.iterations == 3 and given.deploy.state_dir == str(tmp_path)
    user = from_layers({"model": {"policy": "acme/tiny-qwen"}, "data": {"prompts": "x.parquet"}})
    assert user.reinforce.optim.lr == 1e-6 and user.data.prompts == "x.parquet"
    partial = RunConfig.model_validate({"algorithm": "rloo", "reinforce": {"epochs": 1}})
    joined = RLHFConfig.of(partial)
    assert joined.reinforce.optim.lr == TINY_LR and joined.reinforce.epochs == 1
    full = RLHFConfig.of(RunConfig.model_validate(preset("none", **{"model.policy": "tiny/policy"}).run.model_dump()))
    assert full.reinforce.optim.lr == 1e-6  # a config that sets every field keeps every field


@pytest.mark.parametrize("prompts, gold, expected", [
    ("builtin:sentiment", None, "models.tasks.sentiment:gold_reward"),
    ("builtin:sentiment_target", None, "models.tasks.sentiment:gold_reward"),
    ("/data/math.parquet", None, None),
    ("/data/math.parquet", "rewards.py:gold", "rewards.py:gold"),
])
def test_the_gold_reward_is_the_shipped_tasks_only_on_the_shipped_task(prompts, gold, expected):
    assert gold_spec(preset("tiny", **{"data.prompts": prompts, "reward.gold": gold})) == expected


@pytest.mark.parametrize("reward, message", [
    ({"function": "a:f", "functions": ["a:g"]}, "reward.function and reward.functions are both set"),
    ({"source": "function"}, "reward.function (or reward.functions) is required"),
    ({"functions": ["a:f", "b:g"], "weights": [1.0]}, "reward.weights has 1 weight(s) for 2 reward.functions"),
    ({"function": "a:f", "weights": [1.0]}, "reward.weights weighs reward.functions"),
    ({"functions": ["a:f", "not a spec"]}, "reward.functions[1] must look like"),
    ({"function": "path/to/rewards:f"}, "reward.function must look like"),  # a path, but not to a .py file
])
def test_bad_reward_settings_are_refused_naming_the_field(reward, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        preset("tiny", **{f"reward.{k}": v for k, v in reward.items()})


def test_reward_function_names_are_the_functions_names_made_unique():
    cfg = preset("tiny", **{"reward.source": "function",
                            "reward.functions": ["my/rewards.py:exact", "pkg.mod:exact", "pkg.mod:format"],
                            "reward.weights": [1.0, 0.5, 0.1]})
    assert cfg.reward.function_names() == ["exact", "exact_2", "format"]
    assert cfg.reward.function_weights() == [1.0, 0.5, 0.1]


def leaves(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """Every leaf field of a config tree, by dotted name, with its description (walked here, independently)."""
    out = {}
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out.update(leaves(field.annotation, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = field.description
    return out


def described_lines(*args: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["config", "--describe", *args]) == 0
    return out.getvalue().splitlines()


def test_config_describe_all_prints_every_field_with_its_description_and_describe_the_user_s_fields():
    """--describe --all: every field of a run; --describe: all but those their sections mark advanced (request
    limits, threads and cores, timeouts, ports), at most 150 for a run, what a user sets."""
    lines, short = described_lines("run", "--all"), described_lines()
    fields = leaves(RLHFConfig)
    assert len(fields) > 100 and all(fields.values()), [k for k, v in fields.items() if not v]
    for name, description in fields.items():
        at = next((i for i, line in enumerate(lines) if line.startswith(f"{name}  (")), None)
        assert at is not None, name
        assert lines[at + 1].strip() == description, name
    assert "generation.max_new_tokens  (int, default 256; tiny preset 16)" in lines
    shown = [line.split("  (")[0] for line in short if "  (" in line and not line.startswith(" ")]
    assert len(shown) <= 150 and set(shown) < set(fields)
    hidden = set(fields) - set(shown)
    assert {"deploy.critic.port", "deploy.rollout.max_body_mib", "deploy.actor.collective_timeout_s",
            "ppo.optim.betas"} <= hidden
    assert {"algorithm", "model.policy", "kl.beta", "loss.epsilon_high", "deploy.actor.nproc_per_node",
            "deploy.critic.launch"} <= set(shown)


@pytest.mark.parametrize("what, field", [("deploy", "actor.nproc_per_node"), ("pipeline", "dpo.beta"),
                                         ("sft", "sft.epochs"), ("reward-model", "reward_model.center_rewards_coefficient"),
                                         ("dpo", "dpo.loss_type"), ("eval", "eval.samples_per_prompt"),
                                         ("sweep", "metric")])
def test_config_describe_covers_every_config(what, field):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["config", "--describe", what]) == 0
    lines = out.getvalue().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{field}  ("))
    assert lines[at + 1].strip()  # with its description
