"""Rollout engines by name (`rollout.engine` in the config): each builds itself for this rank's policy."""

from __future__ import annotations

from models.rollout.base import Rollout, RolloutEngine
from models.rollout.native import NativeEngine

ENGINES = {"native": NativeEngine.for_policy}


def build_engine(name: str, policy) -> RolloutEngine:
    """The engine `name` for this rank's actor (`policy`: models/policy.Policy)."""
    return ENGINES[name](policy)


__all__ = ["ENGINES", "NativeEngine", "Rollout", "RolloutEngine", "build_engine"]
