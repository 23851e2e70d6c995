"""Held-out evaluation (eval.*): the policy answers prompts it does not train on, scored by the run's own reward and
the gold reward, on every actor rank with its share of the prompts, through the run's rollout engine; in an
environment run, each prompt is an episode against its environment (models/environments/), scored as training is.

It adds no trainer step and leaves the training stream as it is: it samples from a generator of its own (seeded from
the run's seed and the iteration), never the actor's, and touches neither the optimizer, the KL controller nor the
counters. Metrics (rank 0): eval/reward, eval/gold_reward, eval/completions/mean_length; success metrics when every
score is 0 or 1 (a verifiable reward) or eval.success_threshold says what succeeds: eval/success (the share of
samples that succeed; eval/accuracy too for 0/1 scores) and eval/pass_at_<j> for j = 1, 2, 4, ... up to k =
eval.samples_per_prompt (Chen et al. 2021's unbiased estimator from the k samples of each prompt: the chance that
one of j samples succeeds); with reward functions, eval/rewards/<name>/mean and /std of each; in an environment run,
the episodes' tool and environment metrics under eval/ (eval/tools/call_frequency, eval/env/errors, ...).

A policy against a reference policy (the eval job, components/jobs/evaluation.py: judged by a reward model in
models/stages/evaluate.compare_policies, or as an RL run's held-out eval judges) is `compared` here, one metric
scheme for both: the policy's metrics by the names above, the reference's as eval/reference/<name>, and
eval/win_rate, eval/gold_win_rate, eval/success_gain of their paired samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from models.actor import ActorState
from models.algorithms import ALGORITHMS, Backends
from models.config import RLHFConfig, Sampling
from models.data import Batch
from models.reward import RewardFn
from models.environments.episodes import episode_metrics, episode_stats
from models.environments.episodes import episode_rows as episode_rows_table
from models.step import (episode_rows, function_reward_metrics, prompt_ids, reward_names, rollouts_on_leader,
                         sample_rows)
from models.update import micro_batches


@dataclass
class Judged:
    """A policy's held-out samples as an eval judged them (k consecutive samples per prompt): each one's score and
    gold reward (None without one), the metrics and the sample rows."""

    scores: torch.Tensor
    gold: torch.Tensor | None
    metrics: dict[str, float]
    rows: list[dict]


def evaluate(state: ActorState, prompts: Batch, cfg: RLHFConfig, backends: Backends, gold_fn: RewardFn | None,
             iteration: int) -> tuple[dict[str, float], list[dict]]:
    """The held-out eval (`judge`): (metrics, sample rows) on rank 0, ({}, []) elsewhere."""
    judged = judge(state, prompts, cfg, backends, gold_fn, iteration)
    return (judged.metrics, judged.rows) if judged is not None else ({}, [])


def judge(state: ActorState, prompts: Batch, cfg: RLHFConfig, backends: Backends, gold_fn: RewardFn | None,
          iteration: int) -> Judged | None:
    """Sample eval.samples_per_prompt responses per prompt of this rank's share at eval.temperature and score every
    rank's on rank 0; rank 0's judgement, None elsewhere."""
    e, policy, me = cfg.eval, state.policy, state.me
    k = e.samples_per_prompt
    share = me.shard(len(prompts))
    mine = [p for p in prompts.prompts[share] for _ in range(k)]
    columns = [c for c in prompts.columns[share] for _ in range(k)]
    generator = torch.Generator().manual_seed(eval_seed(cfg.seed, iteration, me.rank))
    sampling = Sampling.of(cfg.generation, temperature=e.temperature)  # validated: 0 is greedy
    played = None
    if state.episodes is not None:
        played = state.episodes.play(state.engine, episode_rows(prompts, share, k), sampling, generator,
                                     cfg.generation.max_new_tokens, policy.pad_id)
        rollout = played.rollout
    else:
        rollout = state.engine.generate(prompt_ids(policy, prompts.prompts[share], prompts.templated, cfg), k,
                                        sampling, generator)
    responses = played.responses if played is not None else policy.decode_responses(rollout)
    batch = rollouts_on_leader(me, rollout, mine, responses, columns, policy.pad_id, played)
    stats = me.all_gather_cat(episode_stats(played.episodes)) if played is not None else None
    if batch is None:
        return None
    chunks = micro_batches(len(batch["lengths"]), cfg.generation.micro_batch_size)
    scored = ALGORITHMS[cfg.algorithm].request_scores(batch, chunks, backends)()
    scores = scored["scores"].double()
    gold = (torch.tensor(gold_fn(batch["prompts"], batch["responses"], batch["columns"]), dtype=torch.float64)
            if gold_fn is not None else None)
    lengths = (batch["lengths"] - batch["prompt_lengths"]).double()
    metrics = eval_metrics(scores, gold, lengths, k, e.success_threshold)
    metrics.update({f"eval/{name}": value for name, value in
                    function_reward_metrics(scored, reward_names(state, cfg)).items()})
    if played is not None:
        metrics.update(episode_metrics(stats, prefix="eval/"))
        return Judged(scores, gold, metrics, episode_rows_table(played.episodes, state.episodes.names, e.table_rows))
    return Judged(scores, gold, metrics, eval_rows(batch, scores, gold, e.table_rows))


def eval_seed(seed: int, iteration: int, rank: int) -> int:
    """The eval's own sampling seed: another stream than the actor's (seed + 1_000_003 x rank, models/actor.py)."""
    return (seed * 1_000_033 + 7_919 * (iteration + 1) + 104_729 * rank + 17) % (2**63 - 1)


def eval_metrics(scores: torch.Tensor, gold: torch.Tensor | None, response_lengths: torch.Tensor, k: int,
                 success_threshold: float | None = None) -> dict:
    """Means over every eval sample; success metrics (see the module docstring) when the scores are all 0 or 1 or a
    `success_threshold` is given (samples of a prompt are consecutive, k each)."""
    metrics = {"eval/reward": float(scores.mean()), "eval/completions/mean_length": float(response_lengths.mean()),
               "eval/samples": float(len(scores))}
    if gold is not None:
        metrics["eval/gold_reward"] = float(gold.mean())
    return {**metrics, **success_metrics(scores, k, success_threshold)}


def success_metrics(scores: torch.Tensor, k: int, success_threshold: float | None = None) -> dict:
    """eval/success, eval/accuracy (0/1 scores) and eval/pass_at_<j> of `scores` (k consecutive samples per prompt)
    when every score is 0 or 1 or a `success_threshold` is given; {} otherwise. The RL run's eval and the pipeline's
    eval stage (models/stages/evaluate.py) both report these."""
    binary = bool(((scores == 0) | (scores == 1)).all())
    if not binary and success_threshold is None:
        return {}
    success = scores >= (success_threshold if success_threshold is not None else 1.0)
    metrics = {"eval/success": float(success.double().mean())}
    if binary:
        metrics["eval/accuracy"] = float(scores.double().mean())
    correct = success.view(-1, k).sum(1).tolist()
    for j in pass_ks(k):
        metrics[f"eval/pass_at_{j}"] = sum(pass_at_k(k, c, j) for c in correct) / len(correct)
    return metrics


def pass_ks(k: int) -> list[int]:
    """The j of the pass@j reported for k samples per prompt: 1, 2, 4, ... below k, and k."""
    return sorted({2**i for i in range(k.bit_length()) if 2**i < k} | {k})


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples drawn without replacement from n, c of which succeed, succeeds:
    1 - C(n-c, k) / C(n, k) (Chen et al. 2021's unbiased pass@k estimator)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_rows(batch: dict, scores: torch.Tensor, gold: torch.Tensor | None, limit: int) -> list[dict]:
    """The step's sample rows (prompt, response, score, gold) with each row's data set columns."""
    rows = sample_rows(batch["prompts"], batch["responses"], scores, gold, limit)
    for row, columns in zip(rows, batch["columns"]):
        row.update({f"column/{name}": str(value) for name, value in columns.items()})
    return rows


# ---------------------------------------------------------------- a policy against a reference policy

def compared(policy: Judged, reference: Judged, limit: int) -> tuple[dict[str, float], list[dict]]:
    """A policy under test against a reference policy that sampled the same held-out prompts with one seed (their
    j-th samples paired): the policy's metrics as they are, the reference's as eval/reference/<name>, the share of
    paired samples where the policy's scores higher (eval/win_rate; a tie counts one half) and its gold reward
    (eval/gold_win_rate), the policy's eval/success minus the reference's (eval/success_gain); rows pairing the
    samples (up to `limit`), each side's response (an episode: its conversation), score and gold reward."""
    metrics = {**policy.metrics, **{f"eval/reference/{k.removeprefix('eval/')}": v
                                    for k, v in reference.metrics.items()},
               "eval/win_rate": win_rate(policy.scores, reference.scores)}
    if policy.gold is not None and reference.gold is not None:
        metrics["eval/gold_win_rate"] = win_rate(policy.gold, reference.gold)
    if "eval/success" in policy.metrics and "eval/success" in reference.metrics:
        metrics["eval/success_gain"] = policy.metrics["eval/success"] - reference.metrics["eval/success"]
    rows = []
    for a, b in list(zip(policy.rows, reference.rows))[:limit]:
        row = {"prompt": a["prompt"]}
        for side, sample in (("policy", a), ("reference", b)):
            row.update({side: sample.get("conversation", sample.get("response")), f"{side}_score": sample["score"]})
            if "gold_reward" in sample:
                row[f"{side}_gold_reward"] = sample["gold_reward"]
        rows.append(row)
    return metrics, rows


def win_rate(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of paired samples where a beats b, a tie counting one half."""
    return float(((a > b).double() + 0.5 * (a == b).double()).mean())
