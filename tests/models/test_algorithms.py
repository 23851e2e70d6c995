"""The algorithm interface: what every registered algorithm declares, the config tree built from the registry, and
that no code outside the registry and config validation compares algorithm names."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from models.algorithms import ALGORITHMS, Algorithm
from models.config import RLHFConfig, preset, with_schedule_lengths

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_declares_its_parts(name):
    algorithm = ALGORITHMS[name]
    assert isinstance(algorithm, Algorithm) and algorithm.name == name
    settings = algorithm.Config()
    for field in ("rollout_batch_size", "minibatch_size", "epochs", "optim"):  # what the shared step reads
        assert field in type(settings).model_fields, f"{name}: its section lacks {field}"
    assert algorithm.samples_per_prompt(settings) >= 1
    assert type(algorithm).advantages is not Algorithm.advantages, f"{name} does not define advantages"  # no default
    if algorithm.needs_critic:  # an algorithm with a critic updates it and reports on it
        assert type(algorithm).update_critic is not Algorithm.update_critic


def test_the_config_tree_has_a_section_per_algorithm_and_accepts_only_registered_names():
    fields = RLHFConfig.model_fields
    for algorithm in ALGORITHMS.values():
        assert fields[algorithm.section].annotation is algorithm.Config
        assert issubclass(algorithm.Config, BaseModel) and fields[algorithm.section].description
    with pytest.raises(ValueError, match="algorithm"):
        RLHFConfig(algorithm="dpo")


def test_schedule_lengths_follow_the_algorithm():
    """Optimizer steps per run = iterations x epochs x ceil(rollouts per iteration / minibatch)."""
    ppo = with_schedule_lengths(preset("tiny", algorithm="ppo", iterations=3))
    assert ppo.ppo.optim.total_steps == 3 * 2 * 2 and ppo.reinforce.optim.total_steps is None  # 64 rollouts / 32
    rloo = with_schedule_lengths(preset("tiny", algorithm="rloo", iterations=3))
    assert rloo.reinforce.optim.total_steps == 3 * 2 * 2 and rloo.ppo.optim.total_steps is None  # 16 x 4 / 32
    assert rloo.critic.optim.total_steps == 3 * 2 * 2


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_the_lr_schedules_are_transformers_and_load_its_scheduler_state(schedule, warmup):
    """make_optimizer's schedule multiplies the LR as transformers' get_scheduler did (warm-up, then constant /
    half a cosine / linear to 0 at total_steps, 0 past it), and a scheduler state saved with either loads in the
    other (checkpoints written before the change resume)."""
    import torch
    from transformers import get_scheduler

    from models.loading import make_optimizer
    from models.sections import OptimConfig

    total = 10
    optim = OptimConfig(lr=1.0, schedule=schedule, warmup_steps=warmup, total_steps=total)
    ours = make_optimizer([torch.nn.Parameter(torch.zeros(1))], optim)[1]
    theirs = get_scheduler({"constant": "constant_with_warmup"}.get(schedule, schedule),
                           torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                           num_warmup_steps=warmup, num_training_steps=total)
    factors = {"ours": [], "theirs": []}
    for _ in range(total + 3):
        for name, scheduler in (("ours", ours), ("theirs", theirs)):
            factors[name].append(scheduler.get_last_lr()[0])
            scheduler.optimizer.step()
            scheduler.step()
    assert factors["ours"] == pytest.approx(factors["theirs"], abs=1e-12), factors
    assert factors["ours"][0] == (0.0 if warmup else 1.0)
    assert factors["ours"][total] == (1.0 if schedule == "constant" else 0.0)
    if schedule == "cosine":  # half a cosine period over the decay steps
        decay = total - warmup
        assert factors["ours"][warmup + 1] == pytest.approx(0.5 * (1 + math.cos(math.pi / decay)), abs=1e-12)
    resumed = make_optimizer([torch.nn.Parameter(torch.zeros(1))], optim)[1]
    resumed.load_state_dict(theirs.state_dict())
    assert resumed.last_epoch == theirs.last_epoch
    assert resumed.get_last_lr() == pytest.approx(theirs.get_last_lr())
    theirs.load_state_dict(ours.state_dict())
    assert theirs.last_epoch == ours.last_epoch


# `cfg.algorithm == "ppo"`, `"rloo" != algorithm`, `if algorithm in ("ppo", ...)` (a `for` over names is no comparison)
NAME_COMPARISON = re.compile(r"algorithm\w*\s*(==|!=)|(==|!=)\s*[\w.]*algorithm\b|"
                             r"(?<!for )algorithm\s+(not\s+)?in\s+[(\[{]")


def test_no_code_compares_algorithm_names_outside_the_registry_and_config_validation():
    allowed = {"models/algorithms/__init__.py", "models/config.py"}
    offenders = []
    for folder in ("components", "models", "flows", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in allowed:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if NAME_COMPARISON.search(line.split("#")[0]):
                    offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
