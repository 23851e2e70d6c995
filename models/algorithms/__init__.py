"""The algorithm registry: `ALGORITHMS[name]` for the config's `algorithm`, one entry per recipe
(models/algorithms/recipes.py) over its family of the step (PPO, the critic-free group family, on-policy
distillation). A recipe is a line in RECIPES; a family a file here and one line below."""

from __future__ import annotations

from models.algorithms.base import Advantages, Algorithm, Backends, StepData
from models.algorithms.group import Group, ReinforceConfig
from models.algorithms.opd import OPD
from models.algorithms.ppo import PPO, PPOConfig
from models.algorithms.recipes import RECIPES, LossConfig, Settings, resolve

FAMILIES: dict[str, type[Algorithm]] = {"ppo": PPO, "group": Group, "opd": OPD}
ALGORITHMS: dict[str, Algorithm] = {name: FAMILIES[recipe.family](name) for name, recipe in RECIPES.items()}

__all__ = ["ALGORITHMS", "Advantages", "Algorithm", "Backends", "LossConfig", "PPOConfig", "RECIPES",
           "ReinforceConfig", "Settings", "StepData", "resolve"]
