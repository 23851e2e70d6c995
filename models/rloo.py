"""One REINFORCE/RLOO iteration, top to bottom (on every actor rank). No critic: a reward backend scores k rollouts
per prompt; a rank samples all k of each of its prompts, so groups never split across ranks.

rollout (k per prompt) -> rewards requested on rank 0 for the rollouts of all ranks while every rank computes old +
reference logprobs -> reward_with_kl = score - beta * KL(sequence) -> baseline (leave-one-out by default)
-> loss = -logp * (r_kl - b)
"""

from __future__ import annotations

import torch

from models.actor import (ActorState, Timers, actor_update, common_metrics, request_rewards, rollout_logprobs,
                          rollouts_on_leader, scatter_rows, sequence_kl)
from models.advantages import grpo_advantages, masked_mean, reinforce_plus_plus_advantages, rloo_baseline
from models.backends import RewardBackend
from models.config import RLHFConfig
from models.losses import ppo_policy_loss, reinforce_loss
from models.policy import Rollout
from models.ppo import sample_rows
from models.reward import RewardFn
from models.update import micro_batches


def rloo_step(state: ActorState, prompts: list[str], reward: RewardBackend | None, cfg: RLHFConfig,
              gold_fn: RewardFn | None = None) -> tuple[dict[str, float], list[dict]]:
    """Run one RLOO iteration on this rank's share of `prompts` (each sampled k times); returns (metrics, sample
    rows). `reward` is used on rank 0 only."""
    policy, timers, k = state.policy, Timers(), cfg.reinforce.num_rollouts_per_prompt
    mine = prompts[state.me.shard(len(prompts))]
    expanded = [p for p in mine for _ in range(k)]
    timers.begin("step")
    with timers("generate"):
        rollout = policy.generate(policy.encode_prompts(expanded, cfg.data.chat_template), cfg.generation, state.generator)
    return rloo_train(state, rollout, expanded, reward, cfg, gold_fn, timers, n_rollouts=len(prompts) * k)


def rloo_train(state: ActorState, rollout: Rollout, expanded: list[str], reward: RewardBackend | None, cfg: RLHFConfig,
               gold_fn: RewardFn | None, timers: Timers, n_rollouts: int) -> tuple[dict[str, float], list[dict]]:
    """Everything after the rollout (rows grouped by prompt, k consecutive rows each): rewards, baseline, update."""
    policy, rf, me = state.policy, cfg.reinforce, state.me
    k = rf.num_rollouts_per_prompt
    group_ids = torch.arange(len(expanded) // k).repeat_interleave(k)
    responses = policy.decode_responses(rollout)
    mask = rollout.response_mask

    # 1. rewards for every rank's rollouts on rank 0, overlapping the actor's logprobs
    batch = rollouts_on_leader(me, rollout, expanded, responses, policy.pad_id)
    futures = None
    if batch is not None:
        futures = request_rewards(reward, batch, micro_batches(len(batch["lengths"]), cfg.generation.micro_batch_size))
    old_logp, ref_logp = rollout_logprobs(policy, rollout, cfg, timers, me)
    with timers("reward_wait"):
        results = None if futures is None else {"scores": torch.cat([f.result() for f in futures]).float()}
        scores = scatter_rows(me, results, batch["sizes"] if batch is not None else None)["scores"]
    gold = torch.tensor(gold_fn(expanded, responses)) if gold_fn is not None else None
    if rf.missing_eos_penalty is not None:
        scores = scores - rf.missing_eos_penalty * (~rollout.is_end).float()

    # 2. sequence reward with KL, then the baseline (within a prompt's group: on this rank; batch-wide: all ranks)
    kl_tokens, kl_seq = sequence_kl(old_logp, ref_logp, mask, cfg.kl.estimator)
    beta = state.kl_ctl.value
    non_score = -beta * kl_tokens.sum(1)
    reward_with_kl = scores + non_score
    if rf.advantage_estimator == "rloo":
        advantages = reward_with_kl - rloo_baseline(reward_with_kl, group_ids)
    elif rf.advantage_estimator == "grpo":
        advantages = grpo_advantages(reward_with_kl, group_ids)
    else:
        advantages = _local(me, reinforce_plus_plus_advantages(me.all_gather_cat(reward_with_kl)), len(reward_with_kl))
    if rf.whiten_advantages:
        every = me.all_gather_cat(advantages)
        if len(every) > 1:
            advantages = (advantages - every.mean()) / (every.std() + 1e-8)

    # 3. actor update: REINFORCE loss -logp * (r_kl - b). The first optimizer step is on-policy (ratio = 1, the
    #    gradient is exactly that of -logp * A); later minibatches/epochs reuse the samples, so the ratio to the
    #    behaviour policy is kept and clipped, as TRL's RLOO does (clip_eps=None: plain REINFORCE throughout).
    def loss_fn(logp, entropy, idx):
        m, adv = mask[idx], advantages[idx].unsqueeze(1).expand_as(logp)
        if rf.clip_eps is None:
            loss = reinforce_loss(logp, advantages[idx], m)
            log_ratio = logp.detach() - old_logp[idx]
            stats = {"approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, m), "ratio": masked_mean(log_ratio.exp(), m),
                     "clipfrac": torch.zeros(())}
        else:
            loss, stats = ppo_policy_loss(logp, old_logp[idx], adv, m, rf.clip_eps)
        stats.update(loss=loss.detach(), entropy=masked_mean(entropy.detach(), m))
        return loss, stats

    with timers("train"):
        train_stats = actor_update(state, rollout, loss_fn, rf.minibatch_size, rf.epochs,
                                   cfg.generation.micro_batch_size, rf.optim.grad_clip, cfg.generation.temperature)

    state.iteration += 1
    state.episode += n_rollouts
    timers.stop("step")
    metrics = common_metrics(state, rollout, scores, gold, kl_seq, non_score, old_logp, timers)
    every = me.all_gather_cat(advantages)
    metrics.update({
        "policy/approxkl_avg": train_stats["approx_kl"],
        "policy/clipfrac_avg": train_stats["clipfrac"],
        "policy/entropy_avg": train_stats["entropy"],
        "policy/grad_norm": train_stats["grad_norm"],
        "loss/policy_avg": train_stats["loss"],
        "val/ratio": train_stats["ratio"],
        "val/advantage_mean": float(every.mean()),
        "val/advantage_std": float(every.std()) if len(every) > 1 else 0.0,
    })
    state.kl_ctl.update(metrics["objective/kl"], n_rollouts)
    return metrics, sample_rows(expanded, responses, scores, gold)


def _local(me, values: torch.Tensor, n_local: int) -> torch.Tensor:
    """This rank's rows of a tensor over the rows of all ranks (rank order)."""
    counts = me.all_gather_cat(torch.tensor([n_local]))
    start = int(counts[:me.rank].sum())
    return values[start:start + n_local]
