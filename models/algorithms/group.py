"""The critic-free family (RLOO, GRPO, Dr. GRPO, DAPO, GSPO, CISPO, REINFORCE++-baseline: models/algorithms/recipes.py):
k rollouts per prompt, scored by a reward backend (a rank samples all k of each of its prompts, so groups never split
across ranks); score - beta x KL when the KL is in the reward -> the recipe's estimator over the groups -> the menu's
actor loss.
"""

from __future__ import annotations

from pydantic import Field, PositiveInt, field_validator

from models.advantages import masked_mean
from models.algorithms.base import Advantages, Algorithm, StepData, estimate, non_score_reward
from models.sections import OptimConfig, Section


class ReinforceConfig(Section):
    rollout_batch_size: PositiveInt = Field(
        16, description="Prompts per iteration; each gets `num_rollouts_per_prompt` samples.")
    num_rollouts_per_prompt: int = Field(4, description="k samples per prompt, the group of the baseline (>= 2).")
    minibatch_size: PositiveInt = Field(32, description="Rollouts per actor optimizer step.")
    epochs: PositiveInt = Field(2, description="Passes over each rollout batch.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Actor optimiser.")

    @field_validator("num_rollouts_per_prompt")
    @classmethod
    def _k_at_least_two(cls, v: int) -> int:
        if v < 2:
            raise ValueError(f"must be >= 2 for a group baseline, got {v}")
        return v


class Group(Algorithm):
    section = "reinforce"
    Config = ReinforceConfig
    description = "Batch and optimiser of the critic-free recipes, every algorithm but ppo (their loss: `loss`)."

    def samples_per_prompt(self, settings: ReinforceConfig) -> int:
        return settings.num_rollouts_per_prompt

    def advantages(self, data: StepData, settings: ReinforceConfig) -> Advantages:
        """The recipe's estimator over the groups of the (shaped) scores, with the KL where it is in the reward."""
        scores = data.scored["scores"].float()
        advantages, _ = estimate(data, scores)
        return Advantages(advantages, scores, non_score_reward(data))

    def metrics(self, data: StepData, adv: Advantages, critic_stats) -> dict[str, float]:
        sequences = adv.advantages.sum(1) / data.mask.sum(1).clamp(min=1)
        return {"val/advantage_mean": float(masked_mean(adv.advantages, data.mask)),
                "val/advantage_std": float(sequences.std()) if len(sequences) > 1 else 0.0}
