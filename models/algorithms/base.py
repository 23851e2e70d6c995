"""The algorithm interface: everything one RL algorithm declares; the step they all share is models/step.py.

An algorithm is a small stateless object. It names its config section (a `Section` subclass in its own file, added
to the config tree by the registry), says whether it needs a critic and how many samples it draws per prompt, and
supplies the parts of the step that differ between algorithms:

    request_scores  what rank 0 asks the scoring backends for (rewards; values too when there is a critic)
    advantages      scores + KL -> advantages (its estimator)
    loss            the actor's loss on a micro-batch
    update_critic   (only with a critic) start the critic's update while the actor trains; `critic_stats` waits for it
    metrics         the metrics only it has

Every hook gets plain tensors and config values, so algorithms stay free of the actor, the engines and the servers.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
from torch import Tensor

from models.distributed import Dist
from models.sections import Section

LossFn = Callable[[Tensor, Tensor | None, Tensor], tuple[Tensor, dict]]  # (new logp, entropy, rows) -> (loss, stats)


@dataclass
class Backends:
    """Where scores and values come from (used on rank 0 only): a critic backend and/or a reward backend
    (models/backends.py in process, components/serving/clients.py over HTTP)."""

    critic: object | None = None
    reward: object | None = None


@dataclass
class StepData:
    """What the shared step knows when it asks for advantages: this rank's rollouts and their numbers."""

    tokens: Tensor  # [B, L] right-padded rollouts of this rank
    mask: Tensor  # [B, L-1] response mask over actions
    is_end: Tensor  # [B] the response ended with a stop token
    old_logp: Tensor  # [B, L-1] behaviour logprobs
    scored: dict  # this rank's rows of what `request_scores` returned ("scores" [B], and "values" [B, L'] with a critic)
    kl_tokens: Tensor  # [B, L-1] per-token KL penalty (the configured estimator), masked
    beta: float  # KL coefficient this iteration
    samples_per_prompt: int
    me: Dist
    pad_id: int
    tis: Tensor | None = None  # [B, L-1] truncated importance weights (engine with its own weights), None = all 1


@dataclass
class Advantages:
    advantages: Tensor  # [B] per sequence or [B, L-1] per token
    scores: Tensor  # [B] the scores as the objective sees them (e.g. after a missing-EOS penalty)
    non_score: Tensor  # [B] the KL part of the reward, -beta * KL per sequence
    extra: dict = field(default_factory=dict)  # what the algorithm's own hooks need later (returns, values, ...)


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
        prompts, responses, columns) per micro-batch; return a function that waits for them and gives {"scores": [B]}."""
        futures = request_rewards(backends.reward, batch, chunks)
        return lambda: {"scores": torch.cat([f.result() for f in futures]).float()}

    def advantages(self, data: StepData, settings) -> Advantages:
        raise NotImplementedError

    def loss(self, data: StepData, adv: Advantages, settings) -> LossFn:
        raise NotImplementedError

    def update_critic(self, data: StepData, adv: Advantages, backends: Backends) -> Future | None:
        return None

    def critic_stats(self, future: Future | None, me: Dist) -> dict | None:
        return None

    def metrics(self, data: StepData, adv: Advantages, critic_stats: dict | None) -> dict[str, float]:
        return {}


def request_rewards(reward, batch: dict, chunks: list[slice]) -> list[Future]:
    """Reward requests for the rows of `batch` per micro-batch (futures), as tokens or texts: the backend decides."""
    return [reward.score_async(batch["tokens"][mb], batch["lengths"][mb], batch["prompt_lengths"][mb],
                               batch["prompts"][mb], batch["responses"][mb], batch["columns"][mb]) for mb in chunks]
