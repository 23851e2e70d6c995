"""Rewards: a sequence-classification reward model, or a Python function named 'package.module:function'."""

from __future__ import annotations

import importlib
import math
from typing import Callable

import torch
from torch import Tensor
from transformers import AutoModelForSequenceClassification

from models.loading import DTYPES, disable_dropout, freeze, from_pretrained

RewardFn = Callable[[list[str], list[str]], list[float]]


def load_reward_model(path: str, dtype: str = "float32", device: str | torch.device = "cpu", field: str = "model.reward"):
    """A frozen AutoModelForSequenceClassification with one label (the scalar reward)."""
    model = from_pretrained(AutoModelForSequenceClassification, path, field, dtype=DTYPES[dtype])
    if model.config.num_labels != 1:
        raise ValueError(f"{field}: reward model '{path}' has num_labels={model.config.num_labels}, expected 1")
    return freeze(disable_dropout(model)).to(device)


def _head(model) -> torch.nn.Module:
    for name in ("score", "classifier"):
        if isinstance(getattr(model, name, None), torch.nn.Module):
            return getattr(model, name)
    raise ValueError(f"{type(model).__name__} has no 'score' or 'classifier' head")


@torch.no_grad()
def reward_model_scores(model, tokens: Tensor, lengths: Tensor) -> Tensor:
    """Score [B] read at the last real token (index lengths-1) of right-padded tokens [B, L].

    The head is applied to the backbone's hidden states directly, so a pad token equal to EOS cannot shift the
    position that is scored (the pitfall of pooling by pad_token_id).
    """
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    attention_mask = (positions.unsqueeze(0) < lengths.unsqueeze(1)).long()
    hidden = model.base_model(input_ids=tokens, attention_mask=attention_mask).last_hidden_state
    last = hidden[torch.arange(tokens.shape[0], device=tokens.device), lengths - 1]
    return _head(model)(last).squeeze(-1).float()


def load_reward_function(spec: str, field: str = "reward.function", probe: bool = True) -> RewardFn:
    """Import 'package.module:function' and wrap it so a wrong length or non-finite value fails loudly.

    With `probe`, the function is called once on two dummy samples so a broken function fails before training starts.
    """
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field}: cannot import '{spec}' ({exc}); expected 'package.module:function'") from exc
    if not callable(fn):
        raise ValueError(f"{field}: '{spec}' is not callable")

    def checked(prompts: list[str], responses: list[str]) -> list[float]:
        scores = list(fn(prompts, responses))
        if len(scores) != len(responses):
            raise ValueError(f"{field}: '{spec}' returned {len(scores)} rewards for {len(responses)} responses")
        bad = [i for i, s in enumerate(scores) if not isinstance(s, (int, float)) or not math.isfinite(s)]
        if bad:
            raise ValueError(f"{field}: '{spec}' returned non-finite or non-numeric rewards at indices {bad[:5]}")
        return [float(s) for s in scores]

    checked.__name__ = attr
    if probe:  # fail before training starts, not at the first rollout
        checked(["probe prompt", "probe prompt"], ["probe response", "another response"])
    return checked
