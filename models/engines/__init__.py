"""Rollout engines by name (`rollout.engine` in the config): each builds itself for this rank's policy."""

from __future__ import annotations

from models.engines.base import Rollout, RolloutEngine, Weights
from models.engines.native import NativeEngine
from models.engines.vllm import VLLMEngine

ENGINES = {"native": NativeEngine, "vllm": VLLMEngine}


def build_engine(rollout, policy) -> RolloutEngine:
    """The engine of `rollout` (the config's RolloutConfig) for this rank's actor (`policy`: models/policy.Policy)."""
    return ENGINES[rollout.engine].for_policy(policy, rollout)


__all__ = ["ENGINES", "NativeEngine", "Rollout", "RolloutEngine", "VLLMEngine", "Weights", "build_engine"]
