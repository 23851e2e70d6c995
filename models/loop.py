"""Build the pieces of a run from the config, and the plain in-process training loop (no servers, no Prefect).

The Prefect flows use the same builders and call `ppo_step` / `rloo_step` once per iteration; this loop is what
`rlhf train` and the learning tests run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, Iterator

import torch

from models.actor import ActorState
from models.backends import FunctionReward, LocalCritic, LocalRewardModel
from models.config import RLHFConfig, with_schedule_lengths
from models.critic import CriticTrainer
from models.loading import resolve_device
from models.policy import Policy
from models.ppo import ppo_step
from models.reward import load_reward_function, load_reward_model
from models.rloo import rloo_step


def load_prompts(cfg: RLHFConfig) -> list[str]:
    """'builtin:<task>' or a .txt (one prompt a line) / .jsonl ({"prompt": ...}) file."""
    spec = cfg.data.prompts
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name != "sentiment":
            raise ValueError(f"data.prompts: unknown builtin task {name!r}; known: sentiment")
        from models.tasks import sentiment

        return sentiment.prompts(200, seed=0)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"data.prompts: file '{spec}' does not exist (expected builtin:<task>, .txt or .jsonl)")
    if path.suffix == ".jsonl":
        prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    else:
        prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"data.prompts: file '{spec}' holds no prompt")
    return prompts


def prompt_batches(prompts: list[str], batch_size: int, seed: int, start_batch: int = 0) -> Iterator[list[str]]:
    """Deterministic epochs of shuffled prompts; `start_batch` skips what a resumed run already consumed."""
    per_epoch = max(1, len(prompts) // batch_size)
    index = start_batch
    while True:
        epoch, offset = divmod(index, per_epoch)
        order = list(range(len(prompts)))
        random.Random(seed * 100003 + epoch).shuffle(order)
        if len(prompts) < batch_size:
            order = (order * (batch_size // len(prompts) + 1))
        yield [prompts[i] for i in order[offset * batch_size:(offset + 1) * batch_size]]
        index += 1


def batch_size(cfg: RLHFConfig) -> int:
    return cfg.ppo.rollout_batch_size if cfg.algorithm == "ppo" else cfg.reinforce.rollout_batch_size


def build_actor(cfg: RLHFConfig) -> ActorState:
    torch.manual_seed(cfg.seed)
    policy = Policy.load(cfg.resolve_model_path(cfg.model.policy), cfg.model.lora, cfg.model.dtype,
                         resolve_device(cfg.model.device))
    optim = cfg.ppo.optim if cfg.algorithm == "ppo" else cfg.reinforce.optim
    return ActorState.create(policy, optim, cfg.kl, cfg.seed)


def build_critic_trainer(cfg: RLHFConfig, checkpoint_dir: str | Path | None = None) -> CriticTrainer:
    critic_path = cfg.resolve_model_path(cfg.model.critic) if cfg.model.critic else None
    return CriticTrainer(cfg.critic, critic_path, cfg.resolve_model_path(cfg.model.reward), cfg.critic.combine_reward,
                         cfg.model.dtype, resolve_device(cfg.model.device), checkpoint_dir)


def build_local_reward(cfg: RLHFConfig):
    if cfg.reward.source == "function":
        return FunctionReward(load_reward_function(cfg.reward.function))
    return LocalRewardModel(load_reward_model(cfg.resolve_model_path(cfg.model.reward), cfg.model.dtype,
                                              resolve_device(cfg.model.device)))


def gold_function(cfg: RLHFConfig):
    return load_reward_function(cfg.reward.gold, "reward.gold") if cfg.reward.gold else None


def step_fn(cfg: RLHFConfig, critic=None, reward=None) -> Callable[[ActorState, list[str]], tuple[dict, list[dict]]]:
    """The per-iteration step of the configured algorithm, bound to its backends."""
    gold = gold_function(cfg)
    if cfg.algorithm == "ppo":
        return lambda state, prompts: ppo_step(state, prompts, critic, reward, cfg, gold)
    return lambda state, prompts: rloo_step(state, prompts, reward, cfg, gold)


def train_in_process(cfg: RLHFConfig, on_iteration: Callable[[int, dict], None] | None = None) -> list[dict]:
    """The whole run in this process: in-process critic/reward backends, no checkpoints. Returns metrics per iteration."""
    cfg = with_schedule_lengths(cfg)
    state = build_actor(cfg)
    critic = reward = None
    if cfg.algorithm == "ppo":
        critic = LocalCritic(build_critic_trainer(cfg))
        if not cfg.critic.combine_reward:
            reward = build_local_reward(cfg)
    else:
        reward = build_local_reward(cfg)
    step = step_fn(cfg, critic, reward)
    history = []
    try:
        for i, prompts in zip(range(cfg.iterations), prompt_batches(load_prompts(cfg), batch_size(cfg), cfg.seed)):
            metrics, _ = step(state, prompts)
            history.append(metrics)
            if on_iteration:
                on_iteration(i, metrics)
    finally:
        for backend in (critic, reward):
            if backend is not None:
                backend.close()
    return history
