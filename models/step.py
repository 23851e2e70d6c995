"""One training iteration, the same for every recipe (models/algorithms/ supplies what differs), on every actor rank
with its share of the prompts:

1. rollout     the rollout engine samples k responses per prompt (a rank samples all k of each of its prompts); with
               asynchronous rollouts (rollout.max_off_policy_steps) rank 0 first submits the next batches (`ahead`)
               and this batch's answer was asked for up to that many iterations ago
2. score       rank 0 asks the critic/reward backends about every rank's rollouts (async), while every rank
               computes its behaviour logprobs and (with a KL) the reference's; the answers reach every rank. With
               dynamic sampling (loss.dynamic_sampling) the groups whose k scores are all equal are dropped and the
               next batches of the stream (`reserve`) are sampled and scored until the batch is full
3. advantages  the scores shaped (missing EOS, overlong), the per-token KL to the reference, the mismatch weights of
               an engine with its own weights, then the recipe's estimator on the rows of all ranks (gathered here:
               an algorithm never sees a rank)
4. update      the algorithm's critic update starts on rank 0 (if it has a critic) while the actor runs the menu's
               loss on this rank's rows through the one update loop (models/update.py); then the engine gets the new
               weights
5. metrics     shared metrics (TRL 1.x's names where TRL has the concept: docs/metrics.md) over all ranks, plus the
               algorithm's own

Critic and reward requests go from rank 0 with the rollouts of all ranks: the critic sees the same global batch
whatever the actor's world size (its updates do not depend on it), and one path serves every launch mode (in process,
local server, deployment); NeMo-Aligner also trains its critic from rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from models.actor import ActorState, Timers, actor_update, common_metrics, rollout_logprobs
from models.advantages import kl_penalty, shape_scores
from models.algorithms import ALGORITHMS, Backends, StepData, resolve
from models.algorithms.recipes import Settings
from models.config import RLHFConfig, Sampling
from models.data import Batch
from models.distributed import Dist, all_rows, leader_batch
from models.engines.base import Rollout
from models.environments.episodes import episode_metrics, episode_stats
from models.environments.episodes import episode_rows as episode_rows_table
from models.losses import high_entropy_mask, mismatch_metrics, mismatch_weights
from models.reward import RewardFn
from models.update import micro_batches


@dataclass
class Sampled:
    """This rank's rollouts of an iteration with what was said about them: its prompts, responses and data set
    columns (k consecutive per prompt), and the scores of every rank's rows (rank order), once collected."""

    rollout: Rollout
    prompts: list[str]
    responses: list[str]
    columns: list[dict]
    played: object = None  # an environment run's episodes (models/environments/episodes.Played)
    collect: object = None  # on rank 0: waits for the scores of every rank's rows
    scored: dict | None = None


def train_step(state: ActorState, prompts: list[str] | Batch, cfg: RLHFConfig, backends: Backends,
               gold_fn: RewardFn | None = None, ahead: list[Batch] | None = None,
               reserve: list[Batch] | None = None) -> tuple[dict[str, float], list[dict]]:
    """Run one iteration of `cfg.algorithm` on this rank's share of `prompts` (the global batch: prompt strings, or a
    models/data.Batch with each row's columns for the reward functions); returns (metrics, sample rows). `backends`
    are used on rank 0 only; `ahead`: the next iterations' batches (asynchronous rollouts), submitted by rank 0;
    `reserve`: the next batches of the stream, which dynamic sampling may draw on (metrics["dynamic_sampling/rounds"]
    says how many batches it used, this one included)."""
    algorithm = ALGORITHMS[cfg.algorithm]
    section, settings = algorithm.settings(cfg), resolve(cfg)
    policy, me, timers = state.policy, state.me, Timers()
    k = algorithm.samples_per_prompt(section)
    prompts = prompts if isinstance(prompts, Batch) else Batch(list(prompts))
    timers.begin("step")

    # 1-2. rollout and scores: k samples of each of this rank's prompts, scored on rank 0 (with dynamic sampling, in
    # rounds until enough groups tell their samples apart)
    sampling = Sampling.of(cfg.generation)
    pipelined = cfg.rollout.max_off_policy_steps > 0
    if pipelined and me.is_leader:
        for j, batch in enumerate([prompts, *(ahead or [])]):  # the first of a run (or after a resume) and the next
            state.engine.submit(state.iteration + j, prompt_ids(policy, batch.prompts, batch.templated, cfg), k,
                                sampling, state.generator)
    rounds = {}
    if settings.dynamic_sampling:
        sampled, rounds = dynamic_sample(state, [prompts, *(reserve or [])], cfg, k, sampling, algorithm, backends,
                                         timers)
    else:
        sampled = sample(state, prompts, cfg, k, sampling, algorithm, backends, timers, pipelined)
    rollout, played = sampled.rollout, sampled.played
    own_weights = not state.engine.shares_actor_weights
    trained_version = state.engine.version if own_weights else None  # the weights this iteration trains from
    old_logp, ref_logp, entropy = rollout_logprobs(policy, rollout, cfg, timers, me, engine_weights=own_weights,
                                                   reference=settings.needs_reference,
                                                   entropy=settings.top_entropy_quantile < 1)
    if sampled.scored is None:
        with timers(algorithm.wait_phase):
            sampled.scored = me.broadcast_object(sampled.collect() if sampled.collect is not None else None)
    gold = torch.tensor(gold_fn(sampled.prompts, sampled.responses, sampled.columns)) if gold_fn is not None else None

    # 3. advantages: the shaped scores, the KL to the frozen reference and the engine's mismatch, then the recipe's
    # estimator over the rows of all ranks
    local = step_data(rollout, old_logp, ref_logp, entropy, settings, state.kl_ctl.value, k, policy.pad_id,
                      own_weights)
    data, rows = all_ranks(me, local, sampled.scored)
    data = replace(data, scored={**data.scored, "scores": shape_scores(
        data.scored["scores"].float(), data.is_end, data.mask.sum(1), settings.missing_eos_penalty,
        settings.overlong_buffer_len, settings.overlong_penalty_factor, cfg.generation.max_new_tokens)})
    if settings.top_entropy_quantile < 1:  # over the behaviour policy's entropies of every rank's tokens
        data = replace(data,
                       entropy_mask=high_entropy_mask(data.entropy_mask, data.mask, settings.top_entropy_quantile))
    adv = algorithm.advantages(data, section)

    # 4. update: the critic (rank 0, async) while the actor trains on this rank's rows; then the engine's weights
    critic_future = algorithm.update_critic(data, adv, backends) if me.is_leader else None
    width = local.tokens.shape[1]
    loss_fn, row_norm = algorithm.loss(data.rows(rows, width), adv.rows(rows, width))
    with timers("train"):
        train_stats = actor_update(state, rollout, loss_fn, row_norm, section.minibatch_size, section.epochs,
                                   cfg.generation.micro_batch_size, section.optim.grad_clip,
                                   cfg.generation.temperature, entropy_grad=settings.menu.entropy_coef > 0)
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
    state.episode += len(prompts) * k * int(rounds.get("dynamic_sampling/rounds", 1))  # every rollout sampled
    timers.stop("step")
    kl_seq = ((old_logp - ref_logp) * local.mask).sum(1) if ref_logp is not None else None
    metrics = common_metrics(state, rollout, adv.scores[rows], gold, kl_seq, adv.non_score[rows], old_logp, timers)
    metrics.update({
        "loss": train_stats["loss"],
        "grad_norm": train_stats["grad_norm"],
        "entropy": train_stats["entropy"],
        "clip_ratio/region_mean": train_stats["clipfrac"],
        "policy/approxkl_avg": train_stats["approx_kl"],
        "policy/skipped_steps": float(train_stats["skipped_steps"]),
        "val/ratio": train_stats["ratio"],
        **{name: train_stats[name] for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/dual_mean",
                                                "kl_loss", "vespo/phi_seq_mean") if name in train_stats},
        **rounds,
    })
    if k > 1:  # prompts whose k samples all scored alike: no learning signal from their group
        metrics["frac_reward_zero_std"] = float((~informative_groups(adv.scores, k)).double().mean())
    metrics.update(algorithm.metrics(data, adv, critic_stats))
    metrics.update(function_reward_metrics(data.scored, reward_names(state, cfg)))
    if played is not None:
        metrics.update(episode_metrics(me.all_gather_cat(episode_stats(played.episodes))))
    if own_weights:
        metrics.update(engine_mismatch(data, settings))
        staleness = me.all_gather_cat(trained_version - rollout.versions).double()
        metrics.update({"rollout/staleness_mean": float(staleness.mean()),
                        "rollout/staleness_max": float(staleness.max()),
                        **rollout_clock})
    if settings.needs_reference:
        state.kl_ctl.update(metrics["objective/kl"], len(adv.scores))  # the controller's unit: KL per sequence
    if played is not None:
        return metrics, episode_rows_table(played.episodes, state.episodes.names)
    return metrics, sample_rows(sampled.prompts, sampled.responses, adv.scores[rows], gold)


def sample(state: ActorState, prompts: Batch, cfg: RLHFConfig, k: int, sampling: Sampling, algorithm,
           backends: Backends, timers: Timers, pipelined: bool = False) -> Sampled:
    """This rank's share of `prompts` sampled k times (an environment run: played as episodes), and on rank 0 the
    requests for every rank's scores fired (`collect` waits for them)."""
    policy, me = state.policy, state.me
    share = me.shard(len(prompts))
    mine = [p for p in prompts.prompts[share] for _ in range(k)]
    columns = [c for c in prompts.columns[share] for _ in range(k)]
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
    batch = rollouts_on_leader(me, rollout, mine, responses, columns, policy.pad_id, played)
    collect = None
    if batch is not None:
        collect = algorithm.request_scores(batch, micro_batches(len(batch["lengths"]), cfg.generation.micro_batch_size),
                                           backends)
    return Sampled(rollout, mine, responses, columns, played, collect)


ROLLOUT_FIELDS = ("tokens", "prompt_lengths", "lengths", "is_end", "sample_logprobs")


def dynamic_sample(state: ActorState, batches: list[Batch], cfg: RLHFConfig, k: int, sampling: Sampling, algorithm,
                   backends: Backends, timers: Timers) -> tuple[Sampled, dict[str, float]]:
    """DAPO's dynamic sampling (Yu et al. 2025; veRL's filter_groups): sample and score `batches` in turn (this
    iteration's, then the stream's next ones) until as many groups as this batch has prompts have k scores (as the
    objective sees them, shaped) that are not all equal, or the batches run out; the batch is those groups, the first in
    stream order, topped up with the earliest groups that were dropped (so the optimizer takes its usual steps). Every
    rank then holds its share of the chosen groups, as if they had been one batch: the same rows on 1 and N ranks, the
    order of the stream."""
    me, policy, target = state.me, state.policy, len(batches[0])
    pools, kept = [], 0
    for batch in batches:
        round_ = sample(state, batch, cfg, k, sampling, algorithm, backends, timers)
        with timers(algorithm.wait_phase):
            scored = me.broadcast_object(round_.collect() if round_.collect is not None else None)
        everyone = all_rows(me, {name: getattr(round_.rollout, name) for name in ROLLOUT_FIELDS}, pad_id=policy.pad_id)
        settings = resolve(cfg)  # the scores as the objective sees them (the overlong punishment may tie a group)
        shaped = shape_scores(scored["scores"].float(), everyone["is_end"],
                              everyone["lengths"] - everyone["prompt_lengths"],
                              settings.missing_eos_penalty, settings.overlong_buffer_len,
                              settings.overlong_penalty_factor, cfg.generation.max_new_tokens)
        informative = informative_groups(shaped, k)
        pools.append((batch, everyone, scored, informative))
        kept += int(informative.sum())
        if kept >= target:
            break
    # the kept groups in stream order, then the dropped ones (fillers) in stream order
    chosen = ([(r, g) for r, pool in enumerate(pools) for g in range(len(pool[3])) if pool[3][g]]
              + [(r, g) for r, pool in enumerate(pools) for g in range(len(pool[3])) if not pool[3][g]])[:target]
    mine = chosen[me.shard(target)]

    def take(picks, name):
        values = [pools[r][1][name][g * k:(g + 1) * k] for r, g in picks]
        if values[0].dim() == 2:
            width = max(v.shape[1] for v in values)
            fill = policy.pad_id if name == "tokens" else 0
            values = [torch.nn.functional.pad(v, (0, width - v.shape[1]), value=fill) for v in values]
        return torch.cat(values)

    rollout = trim(Rollout(*(take(mine, name) for name in ROLLOUT_FIELDS)), policy.pad_id)
    scored = {key: torch.cat([pools[r][2][key][g * k:(g + 1) * k] for r, g in chosen])
              for key in pools[0][2] if isinstance(pools[0][2][key], torch.Tensor)}
    prompts = [pools[r][0].prompts[g] for r, g in mine for _ in range(k)]
    columns = [pools[r][0].columns[g] for r, g in mine for _ in range(k)]
    groups = len(pools) * target
    return (Sampled(rollout, prompts, policy.decode_responses(rollout), columns, scored=scored),
            {"dynamic_sampling/rounds": float(len(pools)), "dynamic_sampling/extra_rounds": float(len(pools) - 1),
             "dynamic_sampling/kept_groups": float(min(kept, target)),
             "dynamic_sampling/filled_groups": float(max(0, target - kept)),
             "dynamic_sampling/dropped_share": float(1 - kept / groups) if groups else 0.0})


def trim(rollout: Rollout, pad_id: int) -> Rollout:
    """The rollout cut to its longest row (rows gathered from wider rounds)."""
    width = int(rollout.lengths.max()) if len(rollout) else 1
    return replace(rollout, tokens=rollout.tokens[:, :width], sample_logprobs=rollout.sample_logprobs[:, :width - 1])


def informative_groups(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[groups] whether a prompt's k scores are not all equal (a group whose scores are has no learning signal)."""
    groups = scores.double().view(-1, k)
    return ~torch.isclose(groups.std(1), torch.zeros((), dtype=torch.float64))


def step_data(rollout: Rollout, old_logp, ref_logp, entropy, settings: Settings, beta: float, k: int, pad_id: int,
              own_weights: bool) -> StepData:
    """This rank's rows for the advantages and the loss: the loss mask (truncated responses out when
    loss.mask_truncated_completions), the per-token KL estimate, the mismatch weights of an engine with its own."""
    mask = rollout.loss_mask
    if settings.mask_truncated_completions:
        mask = mask * rollout.is_end.unsqueeze(1).to(mask.dtype)
    kl = (kl_penalty(old_logp, ref_logp, settings.kl_estimator) * mask if ref_logp is not None
          else torch.zeros_like(mask))
    weights = engine = None
    if own_weights:
        engine = rollout.sample_logprobs * mask
        if settings.correction:
            weights = mismatch_weights(old_logp, engine, mask, settings.correction_mode, settings.correction_min,
                                       settings.correction_max)
    return StepData(rollout.tokens, mask, rollout.is_end, old_logp, {}, kl, beta, k, pad_id, settings, ref_logp,
                    engine, weights, entropy)


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
    names = [name for name in ("tokens", "is_end", "is_weights", *StepData.PER_TOKEN)
             if getattr(local, name) is not None]
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


def engine_mismatch(data: StepData, settings: Settings) -> dict[str, float]:
    """How far the engine's logprobs are from the trainer's on the same tokens, over the rows of all ranks (`data`),
    and what the mismatch correction did (TRL's sampling/* names, NeMo-RL's mismatch/* gates)."""
    old, engine, mask = data.old_logp, data.engine_logp, data.mask
    on = mask > 0
    diff = (old - engine).abs()[on]
    weights = data.is_weights if data.is_weights is not None else torch.ones_like(mask)
    units = weights[on] if weights.shape == mask.shape else weights[mask.sum(1) > 0].flatten()
    out = {"sampling/sampling_logp_difference/mean": float(diff.mean()) if len(diff) else 0.0,
           "sampling/sampling_logp_difference/max": float(diff.max()) if len(diff) else 0.0,
           "sampling/importance_sampling_ratio/min": float(units.min()) if len(units) else 1.0,
           "sampling/importance_sampling_ratio/mean": float(units.mean()) if len(units) else 1.0,
           "sampling/importance_sampling_ratio/max": float(units.max()) if len(units) else 1.0}
    out.update(mismatch_metrics(old, engine, mask, settings.correction_mode, settings.correction_min,
                                settings.correction_max))
    return out


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
