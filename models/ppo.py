"""One PPO iteration, top to bottom (the flow calls this once per iteration).

rollout -> critic_infer fired per micro-batch (async) while the actor computes old + reference logprobs -> rewards
-> KL-shaped per-token rewards -> GAE -> critic_train fired (async) -> actor PPO epochs/minibatches -> wait critic -> metrics
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.actor import (ActorState, Timers, actor_update, common_metrics, rollout_logprobs, sequence_kl,
                          token_mean)
from models.advantages import gae, masked_mean, masked_whiten, shape_rewards
from models.backends import CriticBackend, RewardBackend
from models.config import RLHFConfig
from models.losses import entropy_bonus, explained_variance, ppo_policy_loss
from models.reward import RewardFn


def ppo_step(state: ActorState, prompts: list[str], critic: CriticBackend, reward: RewardBackend | None,
             cfg: RLHFConfig, gold_fn: RewardFn | None = None) -> tuple[dict[str, float], list[dict]]:
    """Run one PPO iteration on `prompts`; returns (metrics, sample rows for the tracking table)."""
    policy, timers, ppo = state.policy, Timers(), cfg.ppo
    with timers("step"):
        # 1. rollout
        with timers("generate"):
            rollout = policy.generate(policy.encode_prompts(prompts, cfg.data.chat_template), cfg.generation, state.generator)
            responses = policy.decode_responses(rollout)
        mask = rollout.response_mask

        # 2. critic (values, and rewards when the RM is combined) fired per micro-batch, overlapping the actor's logprobs
        critic_futures, reward_futures = [], []

        def fire(mb: slice) -> None:
            critic_futures.append(critic.infer_async(rollout.tokens[mb], rollout.lengths[mb]))
            if not critic.combined_reward:
                reward_futures.append(reward.score_async(rollout.tokens[mb], rollout.lengths[mb],
                                                         rollout.prompt_lengths[mb], prompts[mb], responses[mb]))

        old_logp, ref_logp = rollout_logprobs(policy, rollout, cfg, timers, between=fire)
        with timers("critic_wait"):
            results = [f.result() for f in critic_futures]
            values = torch.cat([v for v, _ in results])[:, :-1] * mask  # value of prefix t, for action t+1
            scores = torch.cat([r for _, r in results]) if critic.combined_reward else torch.cat([f.result() for f in reward_futures])
        gold = torch.tensor(gold_fn(prompts, responses)) if gold_fn is not None else None

        # 3. KL-shaped rewards and GAE
        kl_tokens, kl_seq = sequence_kl(old_logp, ref_logp, mask, cfg.kl.estimator)
        beta = state.kl_ctl.value
        rewards = shape_rewards(scores, kl_tokens, mask, beta)
        advantages, returns = gae(rewards, values, mask, ppo.discount, ppo.gae_lambda)
        if ppo.whiten_advantages:
            advantages = masked_whiten(advantages, mask)

        # 4. critic update, overlapping the actor update
        critic_future = critic.train_async(rollout.tokens, F.pad(returns, (0, 1)), F.pad(values, (0, 1)), F.pad(mask, (0, 1)))

        # 5. actor update: clipped surrogate (+ entropy bonus)
        def loss_fn(logp, entropy, idx):
            m = mask[idx]
            loss, stats = ppo_policy_loss(logp, old_logp[idx], advantages[idx], m, ppo.ratio_eps)
            if ppo.entropy_coef > 0:
                loss = loss + entropy_bonus(entropy, m, ppo.entropy_coef)
            stats["loss"] = loss.detach()
            stats["entropy"] = masked_mean(entropy.detach(), m)
            return loss, stats

        with timers("train"):
            train_stats = actor_update(state, rollout, loss_fn, ppo.minibatch_size, ppo.epochs,
                                       cfg.generation.micro_batch_size, ppo.optim.grad_clip, cfg.generation.temperature,
                                       entropy_grad=ppo.entropy_coef > 0)
        with timers("critic_train_wait"):
            critic_stats = critic_future.result()

    state.iteration += 1
    state.episode += len(prompts)
    metrics = common_metrics(state, rollout, scores, gold, kl_seq, (-beta * kl_tokens).sum(1), old_logp, timers)
    metrics.update({
        "policy/approxkl_avg": train_stats["approx_kl"],
        "policy/clipfrac_avg": train_stats["clipfrac"],
        "policy/entropy_avg": train_stats["entropy"],
        "policy/grad_norm": train_stats["grad_norm"],
        "loss/policy_avg": train_stats["loss"],
        "loss/value_avg": critic_stats["loss_mean"],
        "val/ratio": train_stats["ratio"],
        "val/clipfrac_avg": critic_stats.get("clipfrac", float("nan")),
        "val/explained_variance": float(explained_variance(values, returns, mask)),
        "val/advantage_mean": token_mean(advantages, mask),
        "val/return_mean": token_mean(returns, mask),
        "val/value_mean": token_mean(values, mask),
        "critic/step": float(critic_stats.get("step", float("nan"))),
    })
    state.kl_ctl.update(metrics["objective/kl"], len(prompts))
    return metrics, sample_rows(prompts, responses, scores, gold)


def sample_rows(prompts, responses, scores, gold, limit: int = 16) -> list[dict]:
    rows = []
    for i in range(min(limit, len(prompts))):
        row = {"prompt": prompts[i], "response": responses[i], "score": float(scores[i])}
        if gold is not None:
            row["gold_reward"] = float(gold[i])
        rows.append(row)
    return rows

