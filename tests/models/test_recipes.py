"""The recipes (models/algorithms/recipes.py): each value of `algorithm` resolves to its paper's settings of the loss
menu, every setting can still be overridden, the old spellings are refused naming the new one, and what a recipe
cannot run is refused before anything starts, naming the field."""

from __future__ import annotations

import pytest

from models.algorithms import ALGORITHMS, RECIPES, resolve
from models.algorithms.recipes import RENAMED, resolved_values
from models.config import RLHFConfig, preset

pytestmark = pytest.mark.fast

# (estimator, scale_rewards, policy loss, ratio level, aggregation, eps, eps_high, beta, KL place, estimator)
EXPECTED = {
    "ppo": ("gae", "group", "ppo", "token", "token-mean", 0.2, 0.2, 0.01, "reward", "k1"),
    "rloo": ("rloo", "group", "ppo", "token", "token-mean", 0.2, 0.2, 0.01, "reward", "k1"),
    "grpo": ("grpo", "group", "ppo", "token", "seq-mean-token-mean", 0.2, 0.2, 0.04, "loss", "k3"),
    "dr_grpo": ("grpo", "none", "ppo", "token", "seq-mean-token-sum-norm", 0.2, 0.2, 0.0, "reward", "k1"),
    "dapo": ("grpo", "group", "ppo", "token", "token-mean", 0.2, 0.28, 0.0, "reward", "k1"),
    "gspo": ("grpo", "group", "ppo", "sequence", "seq-mean-token-mean", 1e-2, 4e-2 / 3, 0.0, "reward", "k1"),
    "cispo": ("grpo", "group", "cispo", "token", "token-mean", 0.2, 5.0, 0.0, "reward", "k1"),
    "reinforce_pp": ("reinforce_pp_baseline", "group", "ppo", "token", "token-mean", 0.2, 0.2, 0.01, "reward", "k1"),
    "opd": ("rloo", "group", "ppo", "token", "token-mean", 0.2, 0.2, 0.0, "reward", "k1"),
}


def config(algorithm: str, **overrides) -> RLHFConfig:
    extra = {"model.teacher": "tiny/policy"} if ALGORITHMS[algorithm].needs_teacher else {}
    return preset("tiny", algorithm=algorithm, **extra, **overrides)


@pytest.mark.parametrize("algorithm", sorted(RECIPES))
def test_each_recipe_resolves_to_its_paper_s_settings(algorithm):
    s = resolve(config(algorithm))
    m = s.menu
    assert (s.advantage_estimator, s.scale_rewards, m.policy_loss, m.importance_sampling_level, m.loss_agg_mode,
            m.epsilon, m.epsilon_high, s.kl_beta, s.kl_placement, s.kl_estimator) == EXPECTED[algorithm]
    assert s.dynamic_sampling == (algorithm == "dapo")
    assert s.overlong_buffer_len == (3 if algorithm == "dapo" else 0)  # a fifth of the tiny preset's 16 new tokens
    assert s.needs_reference == (s.kl_beta > 0) and m.kl_in_loss == (s.kl_placement == "loss")
    assert ALGORITHMS[algorithm].needs_critic == (RECIPES[algorithm].family == "ppo")


def test_every_recipe_is_in_the_config_s_choices_and_the_docs_table():
    from tools.docs import recipes_table

    assert set(RLHFConfig.model_fields["algorithm"].annotation.__args__) == set(RECIPES) == set(EXPECTED)
    table = recipes_table()
    assert all(f"`{name}`" in table for name in RECIPES)


def test_gspo_s_clip_range_is_its_paper_s_but_for_the_tiny_preset_s_learning_rate(tiny_models):
    """GSPO's 3e-4 / 4e-4 are for a learning rate of ~1e-6; the tiny policy trains at 3e-4 (the tiny preset), where
    they clip most sequences after each update's first step: there it is 1e-2 / 1.33e-2 (docs/algorithms.md)."""
    real = RLHFConfig.model_validate({"algorithm": "gspo", "model": {"policy": "org/model", "reward": "org/rm"}})
    assert (resolve(real).menu.epsilon, resolve(real).menu.epsilon_high) == (3e-4, 4e-4)


@pytest.mark.parametrize("field,value", [("loss.epsilon_high", 0.3), ("loss.loss_agg_mode", "seq-mean-token-sum"),
                                         ("kl.beta", 0.02), ("kl.placement", "loss"), ("loss.dynamic_sampling", False),
                                         ("loss.policy_loss", "sapo"), ("loss.scale_rewards", "batch")])
def test_every_setting_of_a_recipe_can_be_overridden(field, value):
    cfg = config("dapo", **{field: value})
    assert resolved_values(cfg)[field] == value
    assert resolved_values(config("dapo"))[field] != value  # the recipe's own value is another


def test_a_recipe_s_values_are_shown_as_they_run_and_unset_fields_stay_unset():
    """The config keeps what the user set (None: the recipe's), so switching the recipe later changes every unset
    setting with it; the run's record shows the resolved values."""
    cfg = config("dapo")
    assert cfg.loss.epsilon_high is None and resolved_values(cfg)["loss.epsilon_high"] == 0.28
    switched = RLHFConfig.model_validate({**cfg.model_dump(), "algorithm": "grpo"})
    assert resolve(switched).menu.epsilon_high == 0.2 and resolve(switched).kl_beta == 0.04


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_spelling_is_refused_naming_the_new_one(old):
    section, name = old.split(".")
    with pytest.raises(ValueError) as info:
        RLHFConfig.model_validate({section: {name: 0.1}})
    assert old in str(info.value) and RENAMED[old].split(" ")[0] in str(info.value)


@pytest.mark.parametrize("overrides,message", [
    ({"algorithm": "rloo", "loss.advantage_estimator": "gae"}, "loss.advantage_estimator='gae' needs a critic"),
    ({"algorithm": "ppo", "loss.advantage_estimator": "grpo"}, "needs gae"),
    ({"algorithm": "ppo", "loss.dynamic_sampling": True}, "loss.dynamic_sampling"),
    ({"algorithm": "dapo", "kl.adaptive": True}, "kl.adaptive"),
    ({"algorithm": "opd"}, "model.teacher"),
    ({"algorithm": "dapo", "rollout.engine": "vllm", "rollout.max_off_policy_steps": 1}, "loss.dynamic_sampling"),
    ({"algorithm": "rloo", "loss.policy_loss": "vespo", "loss.vllm_importance_sampling_mode": "sequence_mask"},
     "vespo"),
    ({"algorithm": "rloo", "loss.vllm_importance_sampling_mode": "token_truncate",
      "loss.vllm_importance_sampling_clip_max": None}, "clip_min, clip_max"),
    ({"algorithm": "rloo", "loss.vllm_importance_sampling_clip_min": 3.0}, "must be below clip_max"),
])
def test_what_a_recipe_cannot_run_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        preset("tiny", **overrides)
