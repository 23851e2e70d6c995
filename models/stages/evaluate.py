"""The pipeline's eval stage and its hand-off checks: model code, in the pipeline's own process.

`compare_policies`: the policy under test (a pipeline's RL or DPO policy) and the reference policy (its SFT policy)
each answer the same held-out prompts (the native engine, one sampling seed for both), the reward model scores every
answer as the RL stage scores rollouts (the policy's tokens when it shares their tokenizer, else the text), and the
gold reward when one is given, so proxy and gold can be read side by side (Gao et al. 2023 measure over-optimisation
so). Its metrics are an RL run's held-out eval's, by one scheme (models/eval.compared): the policy's eval/reward (the
reward model's mean score), eval/gold_reward, eval/completions/mean_length, eval/samples and success metrics; the
reference's as eval/reference/<name>; the win rate of the policy's paired samples by the reward model (a tie counts
one half) and by the gold reward, the gain in success; a table of paired samples.

The hand-off checks load a stage's output as the next stage loads it, before the next starts: a policy as
AutoModelForCausalLM, a reward model as AutoModelForSequenceClassification (models/reward.load_reward_model: any newly
initialised weight is refused, naming it), and the reward model's held-out accuracy is recomputed from the loaded
model to match the one its stage recorded.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from models.config import RolloutConfig, Sampling
from models.data import PromptSet
from models.engines import build_engine
from models.eval import Judged, compared, eval_metrics
from models.loading import from_pretrained
from models.policy import Policy
from models.reward import (HandOffError, load_reward_function, load_reward_model, load_reward_tokenizer,
                           reward_model_scores, same_tokenizer, text_reward_scores)
from models.stages.data import Pairs, right_padded
from models.step import sample_rows


def check_policy(path: str, field: str) -> None:
    """A policy loads as the RL stage and the eval load it, every weight from its checkpoint."""
    _, info = from_pretrained(AutoModelForCausalLM, path, field, dtype=torch.float32, output_loading_info=True)
    missing = sorted(set(info.get("missing_keys") or ()) - {"lm_head.weight"})  # tied to the embeddings
    if missing or info.get("mismatched_keys"):
        mismatched = sorted(k if isinstance(k, str) else k[0] for k in info.get("mismatched_keys") or ())
        raise HandOffError(f"{field}: policy '{path}' loads with newly initialised weights {missing + mismatched}")


@torch.no_grad()
def pair_accuracy(model, tokenizer, pairs: Pairs, micro_batch_size: int = 256) -> float:
    """Share of `pairs` whose chosen sequence the reward model scores above the rejected one."""
    wins = 0
    for start in range(0, len(pairs), micro_batch_size):
        chosen = pairs.chosen[start:start + micro_batch_size]
        rejected = pairs.rejected[start:start + micro_batch_size]
        scores = reward_model_scores(model, *right_padded(chosen + rejected, tokenizer.pad_token_id))
        wins += int((scores[:len(chosen)] > scores[len(chosen):]).sum())
    return wins / len(pairs)


def check_reward_model(path: str, pairs: Pairs | None, recorded: float | None, field: str) -> float | None:
    """The reward model loads as the RL stage loads it (every weight from its checkpoint, one label), and its
    accuracy on its held-out `pairs` recomputed from the loaded model matches the `recorded` one: to one pair (a
    pair scored a near tie may flip between the kernels of the run's ranks and this process). Returns the
    recomputed accuracy (None without held-out pairs)."""
    model = load_reward_model(path, field=field)
    if pairs is None:
        return None
    accuracy = pair_accuracy(model, load_reward_tokenizer(path, field), pairs)
    if recorded is not None and abs(accuracy - recorded) > 1.0 / len(pairs) + 1e-9:
        raise HandOffError(f"{field}: reward model '{path}' scores {accuracy:.4f} of its {len(pairs)} held-out pairs "
                           f"right as loaded, its stage recorded {recorded:.4f}: the saved model is not the one "
                           f"that was evaluated")
    return accuracy


@torch.no_grad()
def compare_policies(policy_path: str, reference_path: str, reward_path: str, prompts: PromptSet, sampling: Sampling,
                     samples: int, gold: str | None, seed: int, table_rows: int, normalize: bool = False,
                     device: torch.device | str = "cpu", success_threshold: float | None = None
                     ) -> tuple[dict, list[dict]]:
    """The policy under test (`policy_path`) against the reference policy (`reference_path`): `samples` responses of
    each per prompt (one sampling seed for both: the j-th responses are paired; a prompt's are consecutive); returns
    (metrics, rows)."""
    reward = load_reward_model(reward_path, normalize=normalize, device=device)
    reward_tokenizer = load_reward_tokenizer(reward_path)
    gold_fn = load_reward_function(gold, "eval.gold") if gold else None
    asked = [p for p in prompts.prompts for _ in range(samples)]
    columns = [c for c in prompts.columns for _ in range(samples)]
    sides = {}
    for side, path in (("policy", policy_path), ("reference", reference_path)):
        policy = Policy.load(path, device=device, field=f"{side} policy", reference=False)
        policy.model.eval()
        engine = build_engine(RolloutConfig(), policy)
        ids = policy.encode_prompts(prompts.prompts, templated=prompts.templated)
        rollout = engine.generate(ids, samples, sampling, torch.Generator().manual_seed(seed))
        responses = policy.decode_responses(rollout)
        if same_tokenizer(policy.tokenizer, reward_tokenizer):  # as the RL stage's token transport scores rollouts
            scores = reward_model_scores(reward, rollout.tokens.to(device), rollout.lengths.to(device)).cpu()
        else:  # as its text transport does
            scores = text_reward_scores(reward, reward_tokenizer, asked, responses).cpu()
        gold_scores = (torch.tensor(gold_fn(asked, responses, columns), dtype=torch.float64)
                       if gold_fn is not None else None)
        scores = scores.double()
        sides[side] = Judged(scores, gold_scores, eval_metrics(scores, gold_scores, rollout.response_lengths.double(),
                                                               samples, success_threshold),
                             sample_rows(asked, responses, scores, gold_scores, table_rows))
    return compared(sides["policy"], sides["reference"], table_rows)
