"""The algorithm interface: everything one RL algorithm declares; the step they all share is models/step.py.

An algorithm is a small stateless object. It names its config section (a `Section` subclass in its own file, added
to the config tree by the registry), says whether it needs a critic and how many samples it draws per prompt, and
supplies the parts of the step that differ between algorithms:

    request_scores  what rank 0 asks the scoring backends for (rewards; values too when there is a critic)
    advantages      scores + KL -> advantages (its estimator), over the rows of all ranks
    loss            the actor's loss on a micro-batch of a rank's rows
    update_critic   (only with a critic) start the critic's update while the actor trains (rank 0: a future)
    metrics         the metrics only it has, over the rows of all ranks

Every hook gets plain tensors and config values, so algorithms stay free of the actor, the engines, the servers and
the ranks: the step gathers every rank's rows before `advantages`, and hands `loss` this rank's share.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
from torch import Tensor

from models.sections import Section

LossFn = Callable[[Tensor, Tensor | None, Tensor], tuple[Tensor, dict]]  # (new logp, entropy, rows) -> (loss, stats)


@dataclass
class Backends:
    """Where scores and values come from (used on rank 0 only): a critic backend and/or a reward backend
    (models/backends.py in process, components/serving/triton/clients.py over HTTP)."""

    critic: object | None = None
    reward: object | None = None


@dataclass
class StepData:
    """What the shared step knows when it asks for advantages: the rollouts of all ranks (rank order, k consecutive
    samples per prompt, right-padded to one width) and their numbers."""

    tokens: Tensor  # [B, L] right-padded rollouts
    mask: Tensor  # [B, L-1] response mask over actions
    is_end: Tensor  # [B] the response ended with a stop token
    old_logp: Tensor  # [B, L-1] the trainer's logprobs before the update (PPO's proximal policy)
    scored: dict  # what `request_scores` returned ("scores" [B], and "values" [B, L'] with a critic)
    kl_tokens: Tensor  # [B, L-1] per-token KL penalty (the configured estimator), masked
    beta: float  # KL coefficient this iteration
    samples_per_prompt: int
    pad_id: int
    tis: Tensor | None = None  # [B, L-1] truncated importance weights (engine with its own weights), None = all 1

    def rows(self, rows: slice, width: int) -> "StepData":
        """The rows `rows`, cut to `width` tokens (a rank's own rows, as wide as its rollout)."""
        return StepData(self.tokens[rows, :width], self.mask[rows, :width - 1], self.is_end[rows],
                        self.old_logp[rows, :width - 1], {k: v[rows] for k, v in self.scored.items()},
                        self.kl_tokens[rows, :width - 1], self.beta, self.samples_per_prompt, self.pad_id,
                        self.tis[rows, :width - 1] if self.tis is not None else None)


@dataclass
class Advantages:
    advantages: Tensor  # [B] per sequence or [B, L-1] per token
    scores: Tensor  # [B] the scores as the objective sees them (e.g. after a missing-EOS penalty)
    non_score: Tensor  # [B] the KL part of the reward, -beta * KL per sequence
    extra: dict = field(default_factory=dict)  # what the algorithm's own hooks need later (returns, values, ...)

    def rows(self, rows: slice, width: int) -> "Advantages":
        """The rows `rows`, per-token tensors cut to the `width - 1` actions of `width` tokens."""
        def cut(t: Tensor) -> Tensor:
            return t[rows, :width - 1] if t.dim() == 2 else t[rows]
        return Advantages(cut(self.advantages), self.scores[rows], self.non_score[rows],
                          {k: cut(v) for k, v in self.extra.items()})


class Algorithm:
    name: ClassVar[str]  # the value of `algorithm` in the config
    section: ClassVar[str]  # the name of its config section in the tree
    Config: ClassVar[type[Section]]  # that section; it has rollout_batch_size, minibatch_size, epochs, optim
    needs_critic: ClassVar[bool] = False
    wait_phase: ClassVar[str] = "reward_wait"  # time/<phase>: waiting for the scores
    description: ClassVar[str] = ""

    def settings(self, cfg) -> Section:
        """This algorithm's section of a config tree."""
        return getattr(cfg, self.section)

    def samples_per_prompt(self, settings) -> int:
        return 1

    def rollouts_per_iteration(self, settings) -> int:
        return settings.rollout_batch_size * self.samples_per_prompt(settings)

    def entropy_grad(self, settings) -> bool:
        """Whether the entropy enters the loss (it then carries a graph)."""
        return False

    def request_scores(self, batch: dict, chunks: list[slice], backends: Backends) -> Callable[[], dict]:
        """On rank 0, fire the requests for every rank's rollouts (`batch`: tokens, lengths, prompt_lengths,
        prompts, responses, columns) per micro-batch; return a function that waits for them and gives {"scores": [B]}
        (and "function_rewards" [B, F] from reward functions: `collect_rewards`)."""
        futures = request_rewards(backends.reward, batch, chunks)
        return lambda: collect_rewards(futures)

    def advantages(self, data: StepData, settings) -> Advantages:
        raise NotImplementedError

    def loss(self, data: StepData, adv: Advantages, settings) -> LossFn:
        raise NotImplementedError

    def update_critic(self, data: StepData, adv: Advantages, backends: Backends) -> Future | None:
        """On rank 0: start the critic's update on the rows of all ranks; the step waits for its stats."""
        return None

    def metrics(self, data: StepData, adv: Advantages, critic_stats: dict | None) -> dict[str, float]:
        return {}


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
