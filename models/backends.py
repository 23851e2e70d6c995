"""Critic and reward *backends*: what the training step talks to, in process or over HTTP.

Both are asynchronous (every call returns a `concurrent.futures.Future`), so the PPO step can fire critic inference per
rollout micro-batch while the actor computes logprobs, and run critic training while the actor trains. The HTTP
implementations (components/serving/triton/clients.py) satisfy the same protocols against the PyTriton servers.
Tensors use the wire layout: right-padded `tokens` [B, L] int64 with `lengths` [B] (prompt + response).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from torch import Tensor

from models.critic import CriticTrainer
from models.scoring import teacher_logprobs
from models.reward import RewardFn, reward_model_scores, text_reward_scores


class CriticBackend(Protocol):
    combined_reward: bool  # critic_infer also returns the reward model's score

    def infer_async(self, tokens: Tensor, lengths: Tensor) -> "Future[tuple[Tensor, Tensor | None]]": ...

    def train_async(self, tokens: Tensor, returns: Tensor, prev_values: Tensor, mask: Tensor) -> "Future[dict]": ...

    def save(self) -> dict: ...


class RewardBackend(Protocol):
    def score_async(self, tokens: Tensor, lengths: Tensor, prompt_lengths: Tensor, prompts: list[str],
                    responses: list[str], columns: list[dict] | None = None) -> "Future[Tensor | dict]":
        """Scores [B], or from reward functions {"scores": [B], "function_rewards": [B, F]} (each function's
        scores); `columns`: each sample's data set row besides the prompt (for reward functions)."""

    def teacher_logprobs_async(self, tokens: Tensor, lengths: Tensor) -> "Future[Tensor]":
        """On-policy distillation (a reward backend that carries a teacher): the teacher's logprobs [B, L-1] of
        each next token."""


class LocalCritic:
    """The critic in this process, on one worker thread (ordered like the server's single lock)."""

    def __init__(self, trainer: CriticTrainer):
        self.trainer = trainer
        self.combined_reward = trainer.token_rewards
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="critic")

    def infer_async(self, tokens, lengths):
        return self._pool.submit(self.trainer.infer, tokens, lengths)

    def train_async(self, tokens, returns, prev_values, mask):
        return self._pool.submit(self.trainer.train, tokens, returns.float(), prev_values.float(), mask.float())

    def save(self) -> dict:
        path = self._pool.submit(self.trainer.save).result()
        return {"step": self.trainer.step, "path": str(path)}

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class LocalRewardModel:
    """A frozen sequence-classification reward model in this process: scores the policy's tokens, or with a
    `tokenizer` of its own (text transport) the prompt and response texts."""

    def __init__(self, model, tokenizer=None, chat_template: bool = False):
        self.model, self.tokenizer, self.chat_template = model, tokenizer, chat_template
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="reward")

    def score_async(self, tokens, lengths, prompt_lengths, prompts, responses, columns=None):
        """A reward model reads no data set column: `columns` is ignored."""
        if self.tokenizer is not None:
            return self._pool.submit(text_reward_scores, self.model, self.tokenizer, list(prompts), list(responses),
                                     self.chat_template)
        device = next(self.model.parameters()).device
        return self._pool.submit(lambda: reward_model_scores(self.model, tokens.to(device), lengths.to(device)).cpu())

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class WithTeacher:
    """A reward backend in this process with on-policy distillation's teacher beside it (`algorithm: opd`): scores
    as `reward` does, and the teacher's logprobs of the student's tokens on a worker thread of its own."""

    def __init__(self, reward, teacher, temperature: float = 1.0, micro_batch_size: int = 64):
        self.reward, self.teacher = reward, teacher
        self.temperature, self.micro_batch_size = temperature, micro_batch_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="teacher")

    def score_async(self, *args, **kwargs):
        return self.reward.score_async(*args, **kwargs)

    def teacher_logprobs_async(self, tokens, lengths):
        return self._pool.submit(teacher_logprobs, self.teacher, tokens, lengths, self.temperature,
                                 self.micro_batch_size)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.reward.close()


class FunctionReward:
    """Python reward functions over decoded text (verifiable rewards); computed at once, returned as a done future:
    the scores [B], or for reward functions with names (models/reward.WeightedRewards) {"scores": [B],
    "function_rewards": [B, F]} (each function's scores, in reward.functions order)."""

    def __init__(self, fn: RewardFn):
        self.fn = fn

    def score_async(self, tokens, lengths, prompt_lengths, prompts, responses, columns=None):
        future: Future = Future()
        try:
            if hasattr(self.fn, "score_all"):
                total, each = self.fn.score_all(prompts, responses, columns)
                future.set_result({"scores": torch.tensor(total, dtype=torch.float32),
                                   "function_rewards":
                                       torch.tensor(each, dtype=torch.float32).reshape(len(each), -1).T})
            else:
                future.set_result(torch.tensor(self.fn(prompts, responses, columns), dtype=torch.float32))
        except Exception as exc:  # noqa: BLE001 - delivered through the future like a remote error
            future.set_exception(exc)
        return future

    def close(self) -> None:
        pass
