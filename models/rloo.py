"""One REINFORCE/RLOO iteration, top to bottom. No critic: a reward backend scores k rollouts per prompt.

rollout (k per prompt) -> reward requests fired per micro-batch while the actor computes old + reference logprobs
-> reward_with_kl = score - beta * KL(sequence) -> baseline (leave-one-out by default) -> loss = -logp * (r_kl - b)
"""

from __future__ import annotations

import torch

from models.actor import ActorState, Timers, actor_update, common_metrics, rollout_logprobs, sequence_kl
from models.advantages import grpo_advantages, masked_mean, reinforce_plus_plus_advantages, rloo_baseline
from models.backends import RewardBackend
from models.config import RLHFConfig
from models.losses import ppo_policy_loss, reinforce_loss
from models.ppo import sample_rows
from models.reward import RewardFn


def rloo_step(state: ActorState, prompts: list[str], reward: RewardBackend, cfg: RLHFConfig,
              gold_fn: RewardFn | None = None) -> tuple[dict[str, float], list[dict]]:
    """Run one RLOO iteration on `prompts` (each sampled k times); returns (metrics, sample rows)."""
    policy, timers, rf = state.policy, Timers(), cfg.reinforce
    k = rf.num_rollouts_per_prompt
    expanded = [p for p in prompts for _ in range(k)]
    group_ids = torch.arange(len(prompts)).repeat_interleave(k)
    with timers("step"):
        # 1. k rollouts per prompt
        with timers("generate"):
            rollout = policy.generate(policy.encode_prompts(expanded, cfg.data.chat_template), cfg.generation, state.generator)
            responses = policy.decode_responses(rollout)
        mask = rollout.response_mask

        # 2. rewards fired per micro-batch, overlapping the actor's logprobs
        futures = []

        def fire(mb: slice) -> None:
            futures.append(reward.score_async(rollout.tokens[mb], rollout.lengths[mb], rollout.prompt_lengths[mb],
                                              expanded[mb], responses[mb]))

        old_logp, ref_logp = rollout_logprobs(policy, rollout, cfg, timers, between=fire)
        with timers("reward_wait"):
            scores = torch.cat([f.result() for f in futures]).float()
        gold = torch.tensor(gold_fn(expanded, responses)) if gold_fn is not None else None
        if rf.missing_eos_penalty is not None:
            scores = scores - rf.missing_eos_penalty * (~rollout.is_end).float()

        # 3. sequence reward with KL, then the baseline
        kl_tokens, kl_seq = sequence_kl(old_logp, ref_logp, mask, cfg.kl.estimator)
        beta = state.kl_ctl.value
        non_score = -beta * kl_tokens.sum(1)
        reward_with_kl = scores + non_score
        if rf.advantage_estimator == "rloo":
            advantages = reward_with_kl - rloo_baseline(reward_with_kl, group_ids)
        elif rf.advantage_estimator == "grpo":
            advantages = grpo_advantages(reward_with_kl, group_ids)
        else:
            advantages = reinforce_plus_plus_advantages(reward_with_kl)
        if rf.whiten_advantages and len(advantages) > 1:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

        # 4. actor update: REINFORCE loss -logp * (r_kl - b). The first optimizer step is on-policy (ratio = 1, the
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
    state.episode += len(expanded)
    metrics = common_metrics(state, rollout, scores, gold, kl_seq, non_score, old_logp, timers)
    metrics.update({
        "policy/approxkl_avg": train_stats["approx_kl"],
        "policy/clipfrac_avg": train_stats["clipfrac"],
        "policy/entropy_avg": train_stats["entropy"],
        "policy/grad_norm": train_stats["grad_norm"],
        "loss/policy_avg": train_stats["loss"],
        "val/ratio": train_stats["ratio"],
        "val/advantage_mean": float(advantages.mean()),
        "val/advantage_std": float(advantages.std()) if len(advantages) > 1 else 0.0,
    })
    state.kl_ctl.update(metrics["objective/kl"], len(expanded))
    return metrics, sample_rows(expanded, responses, scores, gold)
