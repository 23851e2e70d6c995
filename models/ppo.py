"""One PPO iteration, top to bottom (the flow calls this once per iteration, on every actor rank).

rollout (this rank's prompts) -> critic_infer fired on rank 0 for the rollouts of all ranks (async) while every rank
computes old + reference logprobs -> values/rewards back to each rank -> KL-shaped per-token rewards -> GAE ->
advantages whitened over all ranks -> critic_train fired on rank 0 (async) -> actor PPO epochs/minibatches -> metrics.

Critic and reward requests go from rank 0 with the rollouts of all ranks: the critic server sees the same global batch
whatever the actor's world size (its updates do not depend on it), and one path serves every launch mode (in process,
local server, deployment); NeMo-Aligner also trains its critic from rank 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from models.actor import (ActorState, Timers, actor_update, common_metrics, leader_batch, request_rewards,
                          rollout_logprobs, rollouts_on_leader, scatter_rows, sequence_kl, token_mean)
from models.advantages import gae, masked_mean, masked_whiten, shape_rewards
from models.backends import CriticBackend, RewardBackend
from models.config import RLHFConfig
from models.losses import entropy_bonus, explained_variance, ppo_policy_loss
from models.policy import Rollout
from models.reward import RewardFn
from models.update import micro_batches


def ppo_step(state: ActorState, prompts: list[str], critic: CriticBackend | None, reward: RewardBackend | None,
             cfg: RLHFConfig, gold_fn: RewardFn | None = None) -> tuple[dict[str, float], list[dict]]:
    """Run one PPO iteration on this rank's share of `prompts` (the global batch); returns (metrics, sample rows).
    `critic` and `reward` are used on rank 0 only."""
    policy, timers = state.policy, Timers()
    mine = prompts[state.me.shard(len(prompts))]
    timers.begin("step")
    with timers("generate"):
        rollout = policy.generate(policy.encode_prompts(mine, cfg.data.chat_template), cfg.generation, state.generator)
    return ppo_train(state, rollout, mine, critic, reward, cfg, gold_fn, timers, n_prompts=len(prompts))


def ppo_train(state: ActorState, rollout: Rollout, prompts: list[str], critic: CriticBackend | None,
              reward: RewardBackend | None, cfg: RLHFConfig, gold_fn: RewardFn | None, timers: Timers,
              n_prompts: int) -> tuple[dict[str, float], list[dict]]:
    """Everything after the rollout: values and rewards, GAE, critic and actor updates, metrics."""
    policy, ppo, me = state.policy, cfg.ppo, state.me
    responses = policy.decode_responses(rollout)
    mask = rollout.response_mask

    # 1. critic (values, and rewards when the RM is combined) for every rank's rollouts, overlapping the logprobs
    batch = rollouts_on_leader(me, rollout, prompts, responses, policy.pad_id)
    pending = None
    if batch is not None:
        chunks = micro_batches(len(batch["lengths"]), cfg.generation.micro_batch_size)
        pending = ([critic.infer_async(batch["tokens"][mb], batch["lengths"][mb]) for mb in chunks],
                   None if critic.combined_reward else request_rewards(reward, batch, chunks))
    old_logp, ref_logp = rollout_logprobs(policy, rollout, cfg, timers, me)
    with timers("critic_wait"):
        results = None
        if pending is not None:
            answers = [f.result() for f in pending[0]]
            values = torch.cat([v for v, _ in answers])
            scores = (torch.cat([r for _, r in answers]) if pending[1] is None
                      else torch.cat([f.result() for f in pending[1]]))
            results = {"values": values, "scores": scores}
        mine = scatter_rows(me, results, batch["sizes"] if batch is not None else None)
        values = mine["values"][:, :rollout.tokens.shape[1]][:, :-1] * mask  # value of prefix t, for action t+1
        scores = mine["scores"].float()
    gold = torch.tensor(gold_fn(prompts, responses)) if gold_fn is not None else None

    # 2. KL-shaped rewards and GAE (per sequence); advantages whitened over the response tokens of all ranks
    kl_tokens, kl_seq = sequence_kl(old_logp, ref_logp, mask, cfg.kl.estimator)
    beta = state.kl_ctl.value
    rewards = shape_rewards(scores, kl_tokens, mask, beta)
    advantages, returns = gae(rewards, values, mask, ppo.discount, ppo.gae_lambda)
    if ppo.whiten_advantages:
        advantages = masked_whiten(advantages, mask, me=me)

    # 3. critic update on rank 0 (global batch), overlapping the actor update
    train_batch = leader_batch(me, {"tokens": rollout.tokens, "returns": F.pad(returns, (0, 1)),
                                    "prev_values": F.pad(values, (0, 1)), "mask": F.pad(mask, (0, 1))},
                               pad_id=policy.pad_id)
    critic_future = None if train_batch is None else critic.train_async(
        train_batch["tokens"], train_batch["returns"], train_batch["prev_values"], train_batch["mask"])

    # 4. actor update: clipped surrogate (+ entropy bonus)
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
        critic_stats = me.broadcast_object(critic_future.result() if critic_future is not None else None)

    state.iteration += 1
    state.episode += n_prompts
    timers.stop("step")
    metrics = common_metrics(state, rollout, scores, gold, kl_seq, (-beta * kl_tokens).sum(1), old_logp, timers)
    gather = me.all_gather_cat
    g_values, g_returns, g_adv, g_mask = (gather(x) for x in _same_width(me, values, returns, advantages, mask))
    metrics.update({
        "policy/approxkl_avg": train_stats["approx_kl"],
        "policy/clipfrac_avg": train_stats["clipfrac"],
        "policy/entropy_avg": train_stats["entropy"],
        "policy/grad_norm": train_stats["grad_norm"],
        "loss/policy_avg": train_stats["loss"],
        "loss/value_avg": critic_stats["loss_mean"],
        "val/ratio": train_stats["ratio"],
        "val/clipfrac_avg": critic_stats.get("clipfrac", float("nan")),
        "val/explained_variance": float(explained_variance(g_values, g_returns, g_mask)),
        "val/advantage_mean": token_mean(g_adv, g_mask),
        "val/return_mean": token_mean(g_returns, g_mask),
        "val/value_mean": token_mean(g_values, g_mask),
        "critic/step": float(critic_stats.get("step", float("nan"))),
    })
    state.kl_ctl.update(metrics["objective/kl"], n_prompts)
    return metrics, sample_rows(prompts, responses, scores, gold)


def _same_width(me, *tensors: Tensor) -> list[Tensor]:
    """Right-pad [B, T] tensors to the widest T over ranks (for gathering); padding is masked out."""
    width = int(me.all_reduce(torch.tensor(tensors[0].shape[1]), op="max"))
    return [F.pad(t, (0, width - t.shape[1])) for t in tensors]


def sample_rows(prompts, responses, scores, gold, limit: int = 16) -> list[dict]:
    rows = []
    for i in range(min(limit, len(prompts))):
        row = {"prompt": prompts[i], "response": responses[i], "score": float(scores[i])}
        if gold is not None:
            row["gold_reward"] = float(gold[i])
        rows.append(row)
    return rows
