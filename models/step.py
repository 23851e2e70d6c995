"""One training iteration, the same for every algorithm (models/algorithms/ supplies what differs), on every actor
rank with its share of the prompts:

1. rollout     the rollout engine samples k responses per prompt (a rank samples all k of each of its prompts); with
               asynchronous rollouts (rollout.max_off_policy_steps) rank 0 first submits the next batches (`ahead`)
               and this batch's answer was asked for up to that many iterations ago
2. score       rank 0 asks the critic/reward backends about every rank's rollouts (async), while every rank
               computes its behaviour and reference logprobs; the answers reach every rank
3. advantages  per-token KL penalty against the reference, then the algorithm's estimator, on the rows of all ranks
               (gathered here: an algorithm never sees a rank)
4. update      the algorithm's critic update starts on rank 0 (if it has a critic) while the actor runs its loss on
               this rank's rows through the one update loop (models/update.py); then the engine gets the new weights
5. metrics     shared metrics (TRL 1.x's names where TRL has the concept: docs/metrics.md) over all ranks, plus the
               algorithm's own

Critic and reward requests go from rank 0 with the rollouts of all ranks: the critic sees the same global batch
whatever the actor's world size (its updates do not depend on it), and one path serves every launch mode (in process,
local server, deployment); NeMo-Aligner also trains its critic from rank 0.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from models.actor import ActorState, Timers, actor_update, common_metrics, rollout_logprobs, sequence_kl
from models.algorithms import ALGORITHMS, Backends, StepData
from models.config import RLHFConfig, Sampling
from models.data import Batch
from models.distributed import Dist, all_rows, leader_batch
from models.engines.base import Rollout
from models.environments.episodes import episode_metrics, episode_stats
from models.environments.episodes import episode_rows as episode_rows_table
from models.losses import tis_weights
from models.reward import RewardFn
from models.update import micro_batches


def train_step(state: ActorState, prompts: list[str] | Batch, cfg: RLHFConfig, backends: Backends,
               gold_fn: RewardFn | None = None, ahead: list[Batch] | None = None) -> tuple[dict[str, float], list[dict]]:
    """Run one iteration of `cfg.algorithm` on this rank's share of `prompts` (the global batch: prompt strings, or a
    models/data.Batch with each row's columns for the reward functions); returns (metrics, sample rows). `backends`
    are used on rank 0 only; `ahead`: the next iterations' batches (asynchronous rollouts), submitted by rank 0."""
    algorithm = ALGORITHMS[cfg.algorithm]
    settings = algorithm.settings(cfg)
    policy, me, timers = state.policy, state.me, Timers()
    k = algorithm.samples_per_prompt(settings)
    prompts = prompts if isinstance(prompts, Batch) else Batch(list(prompts))
    share = me.shard(len(prompts))
    mine = [p for p in prompts.prompts[share] for _ in range(k)]
    columns = [c for c in prompts.columns[share] for _ in range(k)]
    timers.begin("step")

    # 1. rollout: k samples of each of this rank's prompts (asked for ahead, with asynchronous rollouts)
    sampling = Sampling.of(cfg.generation)
    pipelined = cfg.rollout.max_off_policy_steps > 0
    if pipelined and me.is_leader:
        for j, batch in enumerate([prompts, *(ahead or [])]):  # the first of a run (or after a resume) and the next
            state.engine.submit(state.iteration + j, prompt_ids(policy, batch.prompts, batch.templated, cfg), k,
                                sampling, state.generator)
    played = None
    with timers("generate"):
        if state.episodes is not None:  # an environment run: multi-turn episodes, scored in their workers
            played = state.episodes.play(state.engine, episode_rows(prompts, share, k), sampling, state.generator,
                                         cfg.generation.max_new_tokens, policy.pad_id)
            rollout = played.rollout
        else:
            rollout = state.engine.generate(prompt_ids(policy, prompts.prompts[share], prompts.templated, cfg), k,
                                            sampling, state.generator,
                                            **({"iteration": state.iteration} if pipelined else {}))
    responses = played.responses if played is not None else policy.decode_responses(rollout)

    # 2. score every rank's rollouts on rank 0, overlapping this rank's logprobs
    batch = rollouts_on_leader(me, rollout, mine, responses, columns, policy.pad_id, played)
    collect = None
    if batch is not None:
        chunks = micro_batches(len(batch["lengths"]), cfg.generation.micro_batch_size)
        collect = algorithm.request_scores(batch, chunks, backends)
    own_weights = not state.engine.shares_actor_weights
    trained_version = state.engine.version if own_weights else None  # the weights this iteration trains from
    old_logp, ref_logp = rollout_logprobs(policy, rollout, cfg, timers, me, engine_weights=own_weights)
    with timers(algorithm.wait_phase):
        scored = me.broadcast_object(collect() if collect is not None else None)  # all ranks' rows, rank order
    gold = torch.tensor(gold_fn(mine, responses, columns)) if gold_fn is not None else None

    # 3. advantages: KL against the frozen reference, then the algorithm's estimator over the rows of all ranks
    mask = rollout.loss_mask
    kl_tokens, kl_seq = sequence_kl(old_logp, ref_logp, mask, cfg.kl.estimator)
    tis = tis_weights(old_logp, rollout.sample_logprobs, mask, cfg.rollout.tis_cap) if own_weights else None
    local = StepData(rollout.tokens, mask, rollout.is_end, old_logp, {}, kl_tokens, state.kl_ctl.value, k,
                     policy.pad_id, tis)
    data, rows = all_ranks(me, local, scored)
    adv = algorithm.advantages(data, settings)

    # 4. update: the critic (rank 0, async) while the actor trains on this rank's rows; then the engine's weights
    critic_future = algorithm.update_critic(data, adv, backends) if me.is_leader else None
    with timers("train"):
        train_stats = actor_update(state, rollout, algorithm.loss(data.rows(rows, local.tokens.shape[1]),
                                                                  adv.rows(rows, local.tokens.shape[1]), settings),
                                   settings.minibatch_size, settings.epochs, cfg.generation.micro_batch_size,
                                   settings.optim.grad_clip, cfg.generation.temperature,
                                   entropy_grad=algorithm.entropy_grad(settings))
    critic_stats = None
    if algorithm.needs_critic:
        with timers("critic_train_wait"):
            critic_stats = me.broadcast_object(critic_future.result() if critic_future is not None else None)
    if own_weights:
        idle_before = state.engine.last_refit.get("idle_s")
        with timers("refit"):
            state.engine.update_weights(policy.engine_weights())
        rollout_clock = engine_clock(me, state.engine, idle_before)

    # 5. metrics
    state.iteration += 1
    state.episode += len(prompts) * k
    timers.stop("step")
    metrics = common_metrics(state, rollout, adv.scores[rows], gold, kl_seq, adv.non_score[rows], old_logp, timers)
    metrics.update({
        "loss": train_stats["loss"],
        "grad_norm": train_stats["grad_norm"],
        "entropy": train_stats["entropy"],
        "clip_ratio/region_mean": train_stats["clipfrac"],
        "policy/approxkl_avg": train_stats["approx_kl"],
        "policy/skipped_steps": float(train_stats["skipped_steps"]),
        "val/ratio": train_stats["ratio"],
    })
    if k > 1:  # prompts whose k samples all scored alike: no learning signal from their group
        groups = adv.scores.double().view(-1, k)
        metrics["frac_reward_zero_std"] = float(torch.isclose(groups.std(1), torch.zeros((), dtype=torch.float64)).double().mean())
    metrics.update(algorithm.metrics(data, adv, critic_stats))
    metrics.update(function_reward_metrics(data.scored, reward_names(state, cfg)))
    if played is not None:
        metrics.update(episode_metrics(me.all_gather_cat(episode_stats(played.episodes))))
    if own_weights:
        metrics.update(engine_mismatch(me, old_logp, rollout.sample_logprobs, mask, tis, cfg.rollout.tis_cap))
        staleness = me.all_gather_cat(trained_version - rollout.versions).double()
        metrics.update({"rollout/staleness_mean": float(staleness.mean()), "rollout/staleness_max": float(staleness.max()),
                        **rollout_clock})
    state.kl_ctl.update(metrics["objective/kl"], len(prompts) * k)  # the controller's unit: KL per sequence
    if played is not None:
        return metrics, episode_rows_table(played.episodes, state.episodes.names)
    return metrics, sample_rows(mine, responses, adv.scores[rows], gold)


def reward_names(state, cfg: RLHFConfig) -> list[str]:
    """The names of the reward terms: the reward functions', and in an environment run each environment class's
    with get_reward after them."""
    return state.episodes.names if state.episodes is not None else cfg.reward.function_names()


def episode_rows(prompts: Batch, share: slice, k: int) -> list[dict]:
    """What each of this rank's episodes is reset with: its data set row, the prompt as the data set holds it (a
    string or chat messages); k consecutive episodes per prompt."""
    return [{"prompt": raw, **columns} for raw, columns in zip(prompts.raw[share], prompts.columns[share])
            for _ in range(k)]


def function_reward_metrics(scored: dict, names: list[str]) -> dict[str, float]:
    """rewards/<name>/mean and /std of each reward function (TRL's names) over the rows of all ranks, when the
    scores came from reward functions (their weighted sum is the score); a term that did not score a row (NaN: an
    environment's get_reward on another environment's episode) is left out of its mean."""
    each = scored.get("function_rewards")
    if each is None or each.shape[1] != len(names):
        return {}
    each = each.double()
    out = {}
    for i, name in enumerate(names):
        column = each[:, i][~each[:, i].isnan()]
        if not len(column):
            continue
        out[f"rewards/{name}/mean"] = float(column.mean())
        out[f"rewards/{name}/std"] = float(column.std()) if len(column) > 1 else 0.0
    return out


def all_ranks(me: Dist, local: StepData, scored: dict) -> tuple[StepData, slice]:
    """The step's data over the rows of all ranks (rank order; per-row tensors right-padded to the widest rank's),
    with `scored` (already over all rows), and where this rank's rows are in it."""
    names = ["tokens", "mask", "is_end", "old_logp", "kl_tokens"] + (["tis"] if local.tis is not None else [])
    everyone = all_rows(me, {name: getattr(local, name) for name in names}, pad_id=local.pad_id)
    sizes = everyone.pop("sizes")
    start = sum(sizes[:me.rank])
    return replace(local, scored=scored, **everyone), slice(start, start + sizes[me.rank])


def engine_clock(me: Dist, engine, idle_before: float | None) -> dict[str, float]:
    """time/rollout_wait: how long rank 0 waited for this iteration's rollouts (asynchronous rollouts: the answer asked
    for ahead); time/engine_idle: how long the rollout server neither generated nor loaded weights between the
    previous refit and this one (its own clock); time/refit_wait: how long this refit waited on the server for the
    generation in flight."""
    idle = engine.last_refit.get("idle_s")
    clock = torch.tensor([engine.wait_s if me.is_leader else 0.0,
                          idle - idle_before if me.is_leader and None not in (idle, idle_before) else 0.0,
                          engine.last_refit.get("lock_wait_s", 0.0) if me.is_leader else 0.0])
    wait, engine_idle, refit_wait = me.all_reduce(clock, op="max").tolist()
    return {"time/rollout_wait": wait, "time/engine_idle": engine_idle, "time/refit_wait": refit_wait}


def engine_mismatch(me: Dist, old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                    tis: torch.Tensor, cap: float) -> dict[str, float]:
    """How far the engine's logprobs are from the trainer's on the same tokens (over every rank's response tokens),
    and what truncated importance sampling did about it."""
    diff = me.all_gather_cat(((old_logp - engine_logp).abs() * mask).flatten())
    on = me.all_gather_cat(mask.flatten()) > 0
    weights = me.all_gather_cat(tis.flatten())[on]
    diff = diff[on]
    return {"sampling/sampling_logp_difference/mean": float(diff.mean()) if len(diff) else 0.0,
            "sampling/sampling_logp_difference/max": float(diff.max()) if len(diff) else 0.0,
            "sampling/importance_sampling_ratio/min": float(weights.min()) if len(weights) else 1.0,
            "sampling/importance_sampling_ratio/mean": float(weights.mean()) if len(weights) else 1.0,
            "sampling/importance_sampling_ratio/max": float(weights.max()) if len(weights) else 1.0,
            "rollout/tis_capped_frac": float((weights >= cap).float().mean()) if len(weights) else 0.0}


def prompt_ids(policy, prompts: list[str], templated: bool, cfg: RLHFConfig) -> list[list[int]]:
    """Token ids of prompts for the engine (models/data.encode), cut to their last data.max_prompt_length tokens when
    data.long_prompts='truncate_left' (the other policies dealt with long prompts when the data was read)."""
    ids = policy.encode_prompts(prompts, cfg.data.chat_template, templated)
    limit = cfg.data.max_prompt_length
    if limit and cfg.data.long_prompts == "truncate_left":
        ids = [row[-limit:] for row in ids]
    return ids


def rollouts_on_leader(me: Dist, rollout: Rollout, prompts: list[str], responses: list[str], columns: list[dict],
                       pad_id: int, played=None) -> dict | None:
    """Every rank's rollouts (tokens, lengths, prompt lengths, texts, data set columns) on rank 0, for its
    critic/reward requests; an environment run's episodes bring their scores (models/algorithms/base.request_rewards
    takes them)."""
    fields = {"tokens": rollout.tokens, "lengths": rollout.lengths, "prompt_lengths": rollout.prompt_lengths,
              "prompts": prompts, "responses": responses, "columns": columns}
    if played is not None:
        fields.update(episode_scores=played.scores.float(), episode_values=played.values.float())
    return leader_batch(me, fields, pad_id=pad_id)


def sample_rows(prompts, responses, scores, gold, limit: int = 16) -> list[dict]:
    rows = []
    for i in range(min(limit, len(prompts))):
        row = {"prompt": prompts[i], "response": responses[i], "score": float(scores[i])}
        if gold is not None:
            row["gold_reward"] = float(gold[i])
        rows.append(row)
    return rows
