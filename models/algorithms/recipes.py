"""The recipes: each value of `algorithm` is a named set of the loss menu's settings, as its paper and TRL/veRL define
it, over one family of the step (PPO with a critic, the critic-free group family, on-policy distillation). The menu's
settings live in one section every recipe shares (`loss`, with the KL's in `kl`): a field left unset (None) takes the
recipe's value, any field given overrides it. `resolve(cfg)` is the one place a run's settings are read from
(docs/algorithms.md is generated from RECIPES and the fields below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from models.advantages import ADVANTAGE_ESTIMATORS
from models.losses import AGGREGATIONS, CORRECTIONS, POLICY_LOSSES, Menu
from models.sections import Section

RECIPE = "the recipe's"


class LossConfig(Section):
    """The actor's objective, one menu every recipe shares (docs/algorithms.md): a field left unset takes the value of
    the recipe `algorithm` names; TRL 1.16 GRPOConfig's names where TRL has the setting, else veRL's."""

    advanced: ClassVar[tuple[str, ...]] = ("sapo_temperature_pos", "sapo_temperature_neg", "off_policy_mask_threshold",
                                           "vllm_importance_sampling_clip_min", "dynamic_sampling_extra_rounds",
                                           "overlong_penalty_factor")  # `rlhf config --describe --all` lists them

    advantage_estimator: Optional[Literal[tuple(ADVANTAGE_ESTIMATORS)]] = Field(
        None, description=f"How scores become advantages: gae, rloo, grpo, reinforce_pp(_baseline); None = {RECIPE}.")
    scale_rewards: Optional[Literal["group", "batch", "none"]] = Field(
        None, description=f"grpo: divide the advantage by the group's std, the batch's, or nothing; None = {RECIPE}.")
    whiten_advantages: Optional[bool] = Field(
        None, description=f"Whiten the advantages over the batch's response tokens; None = {RECIPE}.")
    policy_loss: Optional[Literal[tuple(POLICY_LOSSES)]] = Field(
        None, description=f"The per-token policy term: ppo, cispo, sapo, vespo or reinforce; None = {RECIPE}.")
    importance_sampling_level: Optional[Literal["token", "sequence"]] = Field(
        None, description=f"The policy ratio per token, or per sequence (GSPO); None = {RECIPE}.")
    loss_agg_mode: Optional[Literal[tuple(AGGREGATIONS)]] = Field(
        None, description=f"How per-token losses are averaged over the minibatch (all ranks); None = {RECIPE}.")
    epsilon: Optional[float] = Field(None, gt=0, description=f"Clip the ratio below at 1 - epsilon; None = {RECIPE}.")
    epsilon_high: Optional[float] = Field(
        None, gt=0,
        description=f"Clip the ratio above at 1 + epsilon_high (clip-higher); None = {RECIPE}, else epsilon.")
    delta: Optional[float] = Field(
        None, gt=1, description="Two-sided clip: cap the unclipped ratio at delta (INTELLECT-2); None = off.")
    clip_ratio_c: Optional[float] = Field(
        None, gt=1, description="Dual clip: cap a negative-advantage token's loss at c x |A| (veRL); None = off.")
    sapo_temperature_pos: float = Field(1.0, gt=0, description="sapo: gate temperature where A > 0.")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="sapo: gate temperature where A <= 0.")
    entropy_coef: float = Field(
        0.0, ge=0, description="Entropy bonus: subtract coef x the entropy of the trained tokens.")
    top_entropy_quantile: float = Field(
        1.0, gt=0, le=1, description="Train on this highest-entropy share of the response tokens only; 1 = all.")
    mask_truncated_completions: bool = Field(False, description="Responses cut at max_new_tokens carry no loss.")
    missing_eos_penalty: Optional[float] = Field(
        None, description="Subtract this from the score of a response cut at max_new_tokens; None = off.")
    overlong_buffer_len: Optional[NonNegativeInt] = Field(
        None, description=f"DAPO's soft overlong punishment over this many last tokens; 0 = off; None = {RECIPE}.")
    overlong_penalty_factor: float = Field(1.0, ge=0, description="The soft overlong punishment at max_new_tokens.")
    off_policy_mask_threshold: Optional[float] = Field(
        None, gt=0,
        description="Drop a negative-advantage sequence whose sampler KL per token exceeds this; None = off.")
    vllm_importance_sampling_correction: bool = Field(
        True, description="Correct the loss for the rollout engine's own logprobs (engine vllm).")
    vllm_importance_sampling_mode: Literal[tuple(CORRECTIONS)] = Field(
        "token_truncate",
        description="The mismatch weights: per token or per sequence, truncated or masked outside the clips.")
    vllm_importance_sampling_clip_min: Optional[float] = Field(
        None, ge=0, description="Lower bound of the mismatch weights; None = none.")
    vllm_importance_sampling_clip_max: Optional[float] = Field(
        2.0, gt=0, description="Upper bound of the mismatch weights; None = none.")
    dynamic_sampling: Optional[bool] = Field(
        None, description=f"DAPO's dynamic sampling: drop prompts whose k rewards are all equal; None = {RECIPE}.")
    dynamic_sampling_extra_rounds: PositiveInt = Field(
        3, description="Dynamic sampling: at most this many extra generation rounds per iteration.")
    task_reward_weight: float = Field(
        0.0, ge=0, description="opd: weight of the task reward's advantages beside the teacher's signal; 0 = none.")

    @model_validator(mode="after")
    def _bounds(self) -> "LossConfig":
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(f"loss.vllm_importance_sampling_clip_min={low} must be below clip_max={high}")
        if self.vllm_importance_sampling_mode.endswith("truncate") and low is None and high is None:
            raise ValueError(f"loss.vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} truncates to "
                             f"[clip_min, clip_max]: set at least one of them")
        return self


@dataclass(frozen=True)
class Recipe:
    name: str
    family: str  # 'ppo' (a critic), 'group' (k samples per prompt, no critic), 'opd' (a teacher)
    title: str  # what docs/algorithms.md calls it, with its paper
    values: dict[str, Any]  # dotted menu settings (loss.*, kl.*); a callable takes the config
    trl: str  # how TRL 1.16 runs it ('' when it cannot)
    verl: str  # how veRL 0.9 runs it


def fifth_of_max_new_tokens(cfg) -> int:
    """a fifth of generation.max_new_tokens (DAPO: 4096 of 20480)"""
    return max(1, cfg.generation.max_new_tokens // 5)


def gspo_epsilon(cfg) -> float:
    """3e-4 (the tiny preset: 1e-2, see docs/algorithms.md)"""
    return 1e-2 if cfg.preset == "tiny" else 3e-4


def gspo_epsilon_high(cfg) -> float:
    """4e-4 (the tiny preset: 1.33e-2)"""
    return 4e-2 / 3 if cfg.preset == "tiny" else 4e-4


R = Recipe
COMMON = {"loss.scale_rewards": "group", "loss.whiten_advantages": False, "loss.policy_loss": "ppo",
          "loss.importance_sampling_level": "token", "loss.epsilon": 0.2, "loss.dynamic_sampling": False,
          "loss.overlong_buffer_len": 0, "kl.placement": "reward", "kl.estimator": "k1", "kl.beta": 0.01}
RECIPES: dict[str, Recipe] = {r.name: r for r in (
    R("ppo", "ppo", "PPO (Schulman et al. 2017) with a critic, KL in the reward (Ziegler et al. 2019), as NeMo-Aligner",
      {"loss.advantage_estimator": "gae", "loss.whiten_advantages": True, "loss.loss_agg_mode": "token-mean"},
      "PPOTrainer (experimental)", "adv_estimator=gae"),
    R("rloo", "group", "RLOO (Ahmadian et al. 2024): leave-one-out baseline, KL in the reward",
      {"loss.advantage_estimator": "rloo", "loss.loss_agg_mode": "token-mean"},
      "RLOOTrainer", "adv_estimator=rloo"),
    R("grpo", "group", "GRPO (Shao et al. 2024, DeepSeekMath): group-normalised rewards, k3 KL in the loss",
      {"loss.advantage_estimator": "grpo", "loss.loss_agg_mode": "seq-mean-token-mean", "kl.placement": "loss",
       "kl.estimator": "k3", "kl.beta": 0.04},
      "loss_type=grpo, beta=0.04", "adv_estimator=grpo, loss_agg_mode=seq-mean-token-mean, use_kl_loss"),
    R("dr_grpo", "group", "Dr. GRPO (Liu et al. 2025): no std division, a constant normaliser, no KL",
      {"loss.advantage_estimator": "grpo", "loss.scale_rewards": "none",
       "loss.loss_agg_mode": "seq-mean-token-sum-norm",
       "kl.beta": 0.0},
      "loss_type=dr_grpo, scale_rewards=none", "norm_adv_by_std_in_grpo=False, loss_agg_mode=seq-mean-token-sum-norm"),
    R("dapo", "group",
      "DAPO (Yu et al. 2025): clip-higher, token-level loss, dynamic sampling, soft overlong punishment",
      {"loss.advantage_estimator": "grpo", "loss.loss_agg_mode": "token-mean", "loss.epsilon_high": 0.28,
       "loss.dynamic_sampling": True, "loss.overlong_buffer_len": fifth_of_max_new_tokens,
       "kl.beta": 0.0},
      "loss_type=dapo, epsilon_high=0.28 (no dynamic sampling; overlong as a reward function)",
      "recipe/dapo: clip_ratio_high=0.28, filter_groups, overlong_buffer"),
    R("gspo", "group", "GSPO (Zheng et al. 2025): the sequence-level ratio, clipped at 3e-4 / 4e-4",
      {"loss.advantage_estimator": "grpo", "loss.importance_sampling_level": "sequence", "loss.epsilon": gspo_epsilon,
       "loss.epsilon_high": gspo_epsilon_high, "loss.loss_agg_mode": "seq-mean-token-mean", "kl.beta": 0.0},
      "importance_sampling_level=sequence, loss_type=grpo, epsilon=3e-4, epsilon_high=4e-4",
      "policy_loss.loss_mode=gspo, clip_ratio_low=3e-4, clip_ratio_high=4e-4"),
    R("cispo", "group", "CISPO (MiniMax-M1, 2025): a clipped, detached importance weight on every token",
      {"loss.advantage_estimator": "grpo", "loss.policy_loss": "cispo", "loss.epsilon_high": 5.0,
       "loss.loss_agg_mode": "token-mean", "kl.beta": 0.0},
      "loss_type=cispo, epsilon_high=5.0", "policy_loss.loss_mode=cispo"),
    R("reinforce_pp", "group", "REINFORCE++-baseline (Hu 2025): group-mean baseline, batch whitening, KL in the reward",
      {"loss.advantage_estimator": "reinforce_pp_baseline", "loss.loss_agg_mode": "token-mean"},
      "", "adv_estimator=reinforce_plus_plus_baseline, use_kl_in_reward"),
    R("opd", "opd", "On-policy distillation (Agarwal et al. 2024; Thinking Machines 2025): the teacher's per-token "
      "reverse KL on the student's own samples as the advantage",
      {"loss.advantage_estimator": "rloo", "loss.loss_agg_mode": "token-mean", "kl.beta": 0.0},
      "experimental DistillationTrainer (a backpropagated JSD instead)",
      "distillation: use_policy_gradient=True, loss_mode=k1"),
)}

# Each menu setting's name in TRL 1.16 (GRPOConfig) and veRL 0.9, and where it comes from (docs/algorithms.md)
NAMES: dict[str, tuple[str, str, str]] = {
    "loss.advantage_estimator": ("(loss_type / the trainer)", "algorithm.adv_estimator", "per recipe"),
    "loss.scale_rewards": ("scale_rewards", "algorithm.norm_adv_by_std_in_grpo", "Dr. GRPO (Liu et al. 2025)"),
    "loss.whiten_advantages": ("", "(gae whitens)", "PPO (Ziegler et al. 2019)"),
    "loss.policy_loss": ("loss_type (cispo, sapo, vespo)", "actor.policy_loss.loss_mode", "per recipe"),
    "loss.importance_sampling_level": ("importance_sampling_level", "policy_loss.loss_mode=gspo",
                                       "GSPO (Zheng et al. 2025)"),
    "loss.loss_agg_mode": ("loss_type (grpo, dapo, dr_grpo, luspo)", "actor.loss_agg_mode", "DAPO, Dr. GRPO"),
    "loss.epsilon": ("epsilon", "actor.clip_ratio_low", "PPO (Schulman et al. 2017)"),
    "loss.epsilon_high": ("epsilon_high", "actor.clip_ratio_high", "clip-higher: DAPO (Yu et al. 2025)"),
    "loss.delta": ("delta", "", "INTELLECT-2 (Prime Intellect 2025)"),
    "loss.clip_ratio_c": ("", "actor.clip_ratio_c", "dual clip (Ye et al. 2020)"),
    "loss.sapo_temperature_pos": ("sapo_temperature_pos", "actor.policy_loss.tau_pos", "SAPO (Gao et al. 2025)"),
    "loss.sapo_temperature_neg": ("sapo_temperature_neg", "actor.policy_loss.tau_neg", "SAPO (Gao et al. 2025)"),
    "loss.entropy_coef": ("entropy_coef", "actor.entropy_coeff", "PPO"),
    "loss.top_entropy_quantile": ("top_entropy_quantile", "", "Wang et al. 2025 (the 20% forking tokens)"),
    "loss.mask_truncated_completions": ("mask_truncated_completions", "", "DAPO's overlong filtering"),
    "loss.missing_eos_penalty": ("(RLOOTrainer) missing_eos_penalty", "", "TRL"),
    "loss.overlong_buffer_len": ("(a reward function: get_soft_overlong_punishment)", "reward.overlong_buffer.len",
                                 "DAPO"),
    "loss.overlong_penalty_factor": ("(the same)", "reward.overlong_buffer.penalty_factor", "DAPO"),
    "loss.off_policy_mask_threshold": ("off_policy_mask_threshold", "", "DeepSeek-V3.2 (2025)"),
    "loss.vllm_importance_sampling_correction": ("vllm_importance_sampling_correction", "algorithm.rollout_correction",
                                                 "TIS (Yao et al. 2025)"),
    "loss.vllm_importance_sampling_mode": ("vllm_importance_sampling_mode",
                                           "rollout_correction.rollout_is (token, sequence); a 'low_high' threshold "
                                           "masks (IcePop)", "TIS, IcePop, MIS"),
    "loss.vllm_importance_sampling_clip_min": ("vllm_importance_sampling_clip_min",
                                               "rollout_correction.rollout_is_threshold ('low_high')", "as above"),
    "loss.vllm_importance_sampling_clip_max": ("vllm_importance_sampling_clip_max",
                                               "rollout_correction.rollout_is_threshold", "as above"),
    "loss.dynamic_sampling": ("", "algorithm.filter_groups.enable", "DAPO"),
    "loss.dynamic_sampling_extra_rounds": ("", "algorithm.filter_groups.max_num_gen_batches", "DAPO"),
    "loss.task_reward_weight": ("", "distillation.use_task_rewards", "on-policy distillation"),
    "kl.beta": ("beta", "algorithm.kl_ctrl.kl_coef / actor.kl_loss_coef", "Ziegler et al. 2019; GRPO"),
    "kl.placement": ("(the loss, always)", "algorithm.use_kl_in_reward / actor.use_kl_loss", "PPO: reward; GRPO: loss"),
    "kl.estimator": ("(k3)", "algorithm.kl_penalty / actor.kl_loss_type", "Schulman 2020; k3+: veRL"),
}

# Spellings of the settings before the menu, refused naming the new one (a config that used them must be updated)
RENAMED = {
    "ppo.ratio_eps": "loss.epsilon", "ppo.entropy_coef": "loss.entropy_coef",
    "ppo.whiten_advantages": "loss.whiten_advantages",
    "reinforce.advantage_estimator": "algorithm (rloo, grpo or reinforce_pp) or loss.advantage_estimator",
    "reinforce.whiten_advantages": "loss.whiten_advantages",
    "reinforce.clip_eps": "loss.epsilon (clip_eps: null is loss.policy_loss: reinforce)",
    "reinforce.missing_eos_penalty": "loss.missing_eos_penalty",
    "rollout.tis_cap": "loss.vllm_importance_sampling_clip_max",
    "kl.init": "kl.beta",
}


def refuse_old_spellings(data: Any) -> None:
    """Raise naming the new spelling of a setting the config still spells the old way (RENAMED)."""
    if not isinstance(data, dict):
        return
    for old, new in RENAMED.items():
        section, name = old.split(".")
        if old in data or (isinstance(data.get(section), dict) and name in data[section]):
            raise ValueError(f"{old} is now {new} (docs/algorithms.md)")


@dataclass(frozen=True)
class Settings:
    """A run's loss settings, resolved: nothing left to the recipe."""

    recipe: str
    family: str
    menu: Menu
    advantage_estimator: str
    scale_rewards: str
    whiten_advantages: bool
    kl_beta: float
    kl_placement: str
    kl_estimator: str
    top_entropy_quantile: float
    mask_truncated_completions: bool
    missing_eos_penalty: float | None
    overlong_buffer_len: int
    overlong_penalty_factor: float
    correction: bool
    correction_mode: str
    correction_min: float | None
    correction_max: float | None
    dynamic_sampling: bool
    dynamic_sampling_extra_rounds: int
    task_reward_weight: float

    @property
    def needs_reference(self) -> bool:
        """Whether the frozen reference's logprobs are needed: a KL coefficient that is not 0 (or that may move)."""
        return self.kl_beta != 0

    @property
    def kl_in_reward(self) -> bool:
        return self.kl_placement == "reward"


def recipe_values(cfg) -> dict[str, Any]:
    """The recipe's values of every menu setting, for this config (callables evaluated)."""
    recipe = RECIPES[cfg.algorithm]
    values = {**COMMON, **recipe.values}
    return {k: v(cfg) if callable(v) else v for k, v in values.items()}


def resolve(cfg) -> Settings:
    """The run's loss settings: each `loss.*` / `kl.*` field the config sets, else its recipe's value."""
    recipe, values = RECIPES[cfg.algorithm], recipe_values(cfg)

    def get(dotted: str):
        section, name = dotted.split(".")
        given = getattr(getattr(cfg, section), name)
        return given if given is not None else values.get(dotted)

    loss = cfg.loss
    epsilon = get("loss.epsilon")
    high = get("loss.epsilon_high")
    menu = Menu(policy_loss=get("loss.policy_loss"), importance_sampling_level=get("loss.importance_sampling_level"),
                loss_agg_mode=get("loss.loss_agg_mode"), epsilon=epsilon,
                epsilon_high=high if high is not None else epsilon,
                delta=loss.delta, clip_ratio_c=loss.clip_ratio_c, sapo_temperature_pos=loss.sapo_temperature_pos,
                sapo_temperature_neg=loss.sapo_temperature_neg, entropy_coef=loss.entropy_coef,
                off_policy_mask_threshold=loss.off_policy_mask_threshold, kl_in_loss=get("kl.placement") == "loss",
                kl_estimator=get("kl.estimator"), max_len=cfg.generation.max_new_tokens)
    return Settings(
        recipe=recipe.name, family=recipe.family, menu=menu, advantage_estimator=get("loss.advantage_estimator"),
        scale_rewards=get("loss.scale_rewards"), whiten_advantages=get("loss.whiten_advantages"),
        kl_beta=get("kl.beta"), kl_placement=get("kl.placement"), kl_estimator=get("kl.estimator"),
        top_entropy_quantile=loss.top_entropy_quantile, mask_truncated_completions=loss.mask_truncated_completions,
        missing_eos_penalty=loss.missing_eos_penalty, overlong_buffer_len=get("loss.overlong_buffer_len"),
        overlong_penalty_factor=loss.overlong_penalty_factor, correction=loss.vllm_importance_sampling_correction,
        correction_mode=loss.vllm_importance_sampling_mode, correction_min=loss.vllm_importance_sampling_clip_min,
        correction_max=loss.vllm_importance_sampling_clip_max, dynamic_sampling=get("loss.dynamic_sampling"),
        dynamic_sampling_extra_rounds=loss.dynamic_sampling_extra_rounds, task_reward_weight=loss.task_reward_weight)


def resolved_values(cfg) -> dict[str, Any]:
    """Every menu setting as the run uses it, by its dotted field (what a run's record shows next to its config)."""
    values = recipe_values(cfg)
    out = {}
    for section in ("loss", "kl"):
        for name in type(getattr(cfg, section)).model_fields:
            given = getattr(getattr(cfg, section), name)
            out[f"{section}.{name}"] = given if given is not None else values.get(f"{section}.{name}", given)
    if out.get("loss.epsilon_high") is None:
        out["loss.epsilon_high"] = out["loss.epsilon"]
    return out
