"""The algorithm registry: `ALGORITHMS[name]` for the config's `algorithm`. Adding one = a file here + one line below."""

from __future__ import annotations

from models.algorithms.base import Advantages, Algorithm, Backends, StepData
from models.algorithms.ppo import PPO, PPOConfig
from models.algorithms.rloo import RLOO, ReinforceConfig

ALGORITHMS: dict[str, Algorithm] = {algorithm.name: algorithm for algorithm in (PPO(), RLOO())}

__all__ = ["ALGORITHMS", "Advantages", "Algorithm", "Backends", "PPOConfig", "ReinforceConfig", "StepData"]
