"""The algorithm interface: what one family of the RL step declares; the step they all share is models/step.py.

A value of `algorithm` is a recipe (models/algorithms/recipes.py): a named set of the loss menu's settings over one
family of the step. A family is a small stateless object, one instance per recipe that uses it. It names its config
section (a `Section` subclass in its own file, added to the config tree by the registry), says whether it needs a
critic or a teacher and how many samples it draws per prompt, and supplies the parts of the step that differ:

    request_scores  what rank 0 asks the scoring backends for (rewards; values with a critic; a teacher's logprobs)
    advantages      scores + KL -> advantages (loss.advantage_estimator), over the rows of all ranks
    update_critic   (only with a critic) start the critic's update while the actor trains (rank 0: a future)
    metrics         the metrics only it has, over the rows of all ranks

The actor's loss is the same for every family (`Algorithm.loss`: the menu's policy objective, aggregated as the
recipe says). Every hook gets plain tensors and config values, so algorithms stay free of the actor, the engines,
the servers and the ranks: the step gathers every rank's rows before `advantages`, and hands `loss` this rank's share.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Callable, ClassVar

import torch
from torch import Tensor

from models.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, masked_mean, masked_whiten
from models.algorithms.recipes import Settings
from models.losses import AGGREGATIONS, policy_objective
from models.sections import Section

# (new logp, entropy, rows) -> (loss sum, stats)
LossFn = Callable[[Tensor, Tensor | None, Tensor], tuple[Tensor, dict]]


@dataclass
class Backends:
    """Where scores and values come from (used on rank 0 only): a critic backend and/or a reward backend
    (models/backends.py in process, components/serving/triton/clients.py over HTTP)."""

    critic: object | None = None
    reward: object | None = None


@dataclass
class StepData:
    """What the shared step knows when it asks for advantages: the rollouts of all ranks (rank order, k consecutive
    samples per prompt, right-padded to one width), their numbers and the iteration's resolved loss settings."""

    tokens: Tensor  # [B, L] right-padded rollouts
    mask: Tensor  # [B, L-1] the actions that carry a loss (loss.mask_truncated_completions applied)
    is_end: Tensor  # [B] the response ended with a stop token
    old_logp: Tensor  # [B, L-1] the trainer's logprobs before the update (PPO's proximal policy)
    scored: dict  # what `request_scores` returned ("scores" [B], "values" [B, L'] with a critic, "teacher_logp")
    kl_tokens: Tensor  # [B, L-1] per-token KL estimate (kl.estimator), masked; zeros without a reference
    beta: float  # KL coefficient this iteration
    samples_per_prompt: int
    pad_id: int
    settings: Settings
    ref_logp: Tensor | None = None  # [B, L-1] the frozen reference's (None when beta is 0)
    engine_logp: Tensor | None = None  # [B, L-1] the engine's (an engine with its own weights)
    is_weights: Tensor | None = None  # [B, L-1] or [B, 1] mismatch weights (loss.vllm_importance_sampling_*)
    entropy_mask: Tensor | None = None  # [B, L-1] loss.top_entropy_quantile's tokens

    PER_TOKEN = ("mask", "old_logp", "kl_tokens", "ref_logp", "engine_logp", "entropy_mask")

    def rows(self, rows: slice, width: int) -> "StepData":
        """The rows `rows`, cut to `width` tokens (a rank's own rows, as wide as its rollout)."""
        def cut(t: Tensor | None) -> Tensor | None:
            if t is None:
                return None
            return t[rows] if t.shape[1] == 1 else t[rows, :width - 1]
        return replace(self, tokens=self.tokens[rows, :width], is_end=self.is_end[rows],
                       scored={k: v[rows] for k, v in self.scored.items()}, is_weights=cut(self.is_weights),
                       **{name: cut(getattr(self, name)) for name in self.PER_TOKEN})


@dataclass
class Advantages:
    advantages: Tensor  # [B, L-1] per token (a sequence's advantage on each of its actions)
    scores: Tensor  # [B] the scores as the objective sees them (after the score shaping)
    non_score: Tensor  # [B] the KL part of the reward, -beta * KL per sequence (0 with the KL in the loss)
    extra: dict = field(default_factory=dict)  # what the algorithm's own hooks need later (returns, values, ...)

    def rows(self, rows: slice, width: int) -> "Advantages":
        """The rows `rows`, per-token tensors cut to the `width - 1` actions of `width` tokens."""
        def cut(t: Tensor) -> Tensor:
            return t[rows, :width - 1] if t.dim() == 2 else t[rows]
        return Advantages(cut(self.advantages), self.scores[rows], self.non_score[rows],
                          {k: cut(v) for k, v in self.extra.items()})


class Algorithm:
    name: str  # the value of `algorithm` in the config (a recipe: models/algorithms/recipes.py)
    section: ClassVar[str]  # the name of its config section in the tree
    Config: ClassVar[type[Section]]  # that section; it has rollout_batch_size, minibatch_size, epochs, optim
    needs_critic: ClassVar[bool] = False
    needs_teacher: ClassVar[bool] = False
    wait_phase: ClassVar[str] = "reward_wait"  # time/<phase>: waiting for the scores
    description: ClassVar[str] = ""

    def __init__(self, name: str):
        self.name = name

    def settings(self, cfg) -> Section:
        """This algorithm's section of a config tree."""
        return getattr(cfg, self.section)

    def samples_per_prompt(self, settings) -> int:
        return 1

    def rollouts_per_iteration(self, settings) -> int:
        return settings.rollout_batch_size * self.samples_per_prompt(settings)

    def request_scores(self, batch: dict, chunks: list[slice], backends: Backends) -> Callable[[], dict]:
        """On rank 0, fire the requests for every rank's rollouts (`batch`: tokens, lengths, prompt_lengths,
        prompts, responses, columns) per micro-batch; return a function that waits for them and gives {"scores": [B]}
        (and "function_rewards" [B, F] from reward functions: `collect_rewards`)."""
        futures = request_rewards(backends.reward, batch, chunks)
        return lambda: collect_rewards(futures)

    def advantages(self, data: StepData, settings) -> Advantages:
        raise NotImplementedError

    def loss(self, data: StepData, adv: Advantages) -> tuple[LossFn, Tensor]:
        """The actor's loss on a micro-batch of this rank's rows (models/losses.policy_objective, aggregated over the
        micro-batch by loss.loss_agg_mode), and each row's weight [B] in that aggregate: the update loop weighs each
        micro-batch by its rows' share of the minibatch's weight over all ranks, which makes the minibatch's loss the
        aggregate over all its rows whatever the ranks and micro-batches (models/update.py)."""
        settings = data.settings
        menu = settings.menu
        scale, norm = AGGREGATIONS[menu.loss_agg_mode](data.mask, menu.max_len)

        def loss_fn(logp, entropy, idx):
            m = data.mask[idx]
            def pick(t):
                return t[idx] if t is not None else None

            per_token, stats = policy_objective(
                logp, data.old_logp[idx], adv.advantages[idx], m, menu, ref_logp=pick(data.ref_logp), beta=data.beta,
                entropy=entropy, entropy_mask=pick(data.entropy_mask), is_weights=pick(data.is_weights),
                engine_logp=pick(data.engine_logp))
            loss = (scale[idx].unsqueeze(1) * per_token * m).sum() / norm[idx].sum().clamp(min=1e-12)
            stats.update(loss=loss.detach(), entropy=masked_mean(entropy.detach(), m))
            return loss, stats
        return loss_fn, norm

    def update_critic(self, data: StepData, adv: Advantages, backends: Backends) -> Future | None:
        """On rank 0: start the critic's update on the rows of all ranks; the step waits for its stats."""
        return None

    def metrics(self, data: StepData, adv: Advantages, critic_stats: dict | None) -> dict[str, float]:
        return {}


def estimator_inputs(data: StepData, scores: Tensor, **extra) -> AdvantageInputs:
    """The advantage estimator's inputs: the shaped scores, and the KL in the reward when it is placed there."""
    settings = data.settings
    beta = data.beta if settings.kl_in_reward else 0.0
    return AdvantageInputs(scores=scores, kl=data.kl_tokens, beta=beta, mask=data.mask,
                           group_size=data.samples_per_prompt, scale_rewards=settings.scale_rewards, **extra)


def estimate(data: StepData, scores: Tensor, **extra) -> tuple[Tensor, Tensor | None]:
    """Advantages [B, T] (whitened over the response tokens when loss.whiten_advantages) and the returns (gae)."""
    out = ADVANTAGE_ESTIMATORS[data.settings.advantage_estimator](estimator_inputs(data, scores, **extra))
    advantages = masked_whiten(out.advantages, data.mask) if data.settings.whiten_advantages else out.advantages
    return advantages, out.returns


def non_score_reward(data: StepData) -> Tensor:
    """-beta x the sequence's KL where it is part of the reward (objective/non_score_reward), else 0."""
    if not data.settings.kl_in_reward:
        return torch.zeros(data.tokens.shape[0])
    return -data.beta * data.kl_tokens.sum(1)


def request_rewards(reward, batch: dict, chunks: list[slice]) -> list[Future]:
    """Reward requests for the rows of `batch` per micro-batch (futures), as tokens or texts: the backend decides. An
    environment run's rows were scored in their episodes (models/environments/): their scores, as answers."""
    if "episode_scores" in batch:
        return [done({"scores": batch["episode_scores"][mb], "function_rewards": batch["episode_values"][mb]})
                for mb in chunks]
    return [reward.score_async(batch["tokens"][mb], batch["lengths"][mb], batch["prompt_lengths"][mb],
                               batch["prompts"][mb], batch["responses"][mb], batch["columns"][mb]) for mb in chunks]


def done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def collect_rewards(futures: list[Future]) -> dict:
    """The answers of `request_rewards`, in order: {"scores": [B]}, and {"function_rewards": [B, F]} (each reward
    function's scores) when the backend scores with reward functions."""
    answers = [f.result() for f in futures]
    out = {"scores": torch.cat([a["scores"] if isinstance(a, dict) else a for a in answers]).float()}
    if answers and all(isinstance(a, dict) and "function_rewards" in a for a in answers):
        out["function_rewards"] = torch.cat([a["function_rewards"] for a in answers]).float()
    return out
