"""Held-out evaluation (eval.*): the policy answers prompts it does not train on, scored by the run's own reward and
the gold reward, on every actor rank with its share of the prompts, through the run's rollout engine.

It adds no trainer step and leaves the training stream as it is: it samples from a generator of its own (seeded from
the run's seed and the iteration), never the actor's, and touches neither the optimizer, the KL controller nor the
counters. Metrics (rank 0): eval/reward, eval/gold_reward, eval/completions/mean_length; when every score is 0 or 1 (a
verifiable reward), eval/accuracy and eval/pass_at_k (pass@k, k = eval.samples_per_prompt: a prompt passes when one
of its k samples scores 1); with reward functions, eval/rewards/<name>/mean and /std of each.
"""

from __future__ import annotations

import torch

from models.actor import ActorState
from models.algorithms import ALGORITHMS, Backends
from models.config import RLHFConfig, Sampling
from models.data import Batch
from models.reward import RewardFn
from models.step import function_reward_metrics, prompt_ids, rollouts_on_leader, sample_rows
from models.update import micro_batches


def is_eval_iteration(cfg: RLHFConfig, iteration: int) -> bool:
    """Whether the eval runs before iteration `iteration + 1` (at 0, before any update, and every eval.every); the
    caller adds the one at the end."""
    return bool(cfg.eval.prompts) and cfg.eval.every > 0 and iteration % cfg.eval.every == 0


def evaluate(state: ActorState, prompts: Batch, cfg: RLHFConfig, backends: Backends, gold_fn: RewardFn | None,
             iteration: int) -> tuple[dict[str, float], list[dict]]:
    """Sample eval.samples_per_prompt responses per prompt of this rank's share at eval.temperature and score every
    rank's on rank 0; returns (metrics, sample rows) on rank 0, ({}, []) elsewhere."""
    e, policy, me = cfg.eval, state.policy, state.me
    k = e.samples_per_prompt
    share = me.shard(len(prompts))
    mine = [p for p in prompts.prompts[share] for _ in range(k)]
    columns = [c for c in prompts.columns[share] for _ in range(k)]
    generator = torch.Generator().manual_seed(eval_seed(cfg.seed, iteration, me.rank))
    sampling = Sampling.of(cfg.generation, temperature=e.temperature)  # validated: 0 is greedy
    rollout = state.engine.generate(prompt_ids(policy, prompts.prompts[share], prompts.templated, cfg), k, sampling,
                                    generator)
    responses = policy.decode_responses(rollout)
    batch = rollouts_on_leader(me, rollout, mine, responses, columns, policy.pad_id)
    if batch is None:
        return {}, []
    chunks = micro_batches(len(batch["lengths"]), cfg.generation.micro_batch_size)
    scored = ALGORITHMS[cfg.algorithm].request_scores(batch, chunks, backends)()
    scores = scored["scores"].double()
    gold = (torch.tensor(gold_fn(batch["prompts"], batch["responses"], batch["columns"]), dtype=torch.float64)
            if gold_fn is not None else None)
    lengths = (batch["lengths"] - batch["prompt_lengths"]).double()
    metrics = eval_metrics(scores, gold, lengths, k)
    metrics.update({f"eval/{name}": value for name, value in
                    function_reward_metrics(scored, cfg.reward.function_names()).items()})
    return metrics, eval_rows(batch, scores, gold, e.table_rows)


def eval_seed(seed: int, iteration: int, rank: int) -> int:
    """The eval's own sampling seed: another stream than the actor's (seed + 1_000_003 x rank, models/actor.py)."""
    return (seed * 1_000_033 + 7_919 * (iteration + 1) + 104_729 * rank + 17) % (2**63 - 1)


def eval_metrics(scores: torch.Tensor, gold: torch.Tensor | None, response_lengths: torch.Tensor, k: int) -> dict:
    """Means over every eval sample; accuracy and pass@k when the scores are all 0 or 1 (samples of a prompt are
    consecutive, k each)."""
    metrics = {"eval/reward": float(scores.mean()), "eval/completions/mean_length": float(response_lengths.mean()),
               "eval/samples": float(len(scores))}
    if gold is not None:
        metrics["eval/gold_reward"] = float(gold.mean())
    if bool(((scores == 0) | (scores == 1)).all()):
        metrics["eval/accuracy"] = float(scores.mean())
        metrics[f"eval/pass_at_{k}"] = float(scores.view(-1, k).amax(dim=1).mean())
    return metrics


def eval_rows(batch: dict, scores: torch.Tensor, gold: torch.Tensor | None, limit: int) -> list[dict]:
    """The step's sample rows (prompt, response, score, gold) with each row's data set columns."""
    rows = sample_rows(batch["prompts"], batch["responses"], scores, gold, limit)
    for row, columns in zip(rows, batch["columns"]):
        row.update({f"column/{name}": str(value) for name, value in columns.items()})
    return rows
