"""The frame every training flow shares, read top to bottom:

prepare the run (models/prepare.py) and read its data (models/data.py) -> open or resume it -> start the rollout
server when the engine holds its own weights (it loads beside the actor) -> start the actor on its ranks, restored
from the run's checkpoint -> the run's services: the rollout server given the actor's weights, and what the algorithm
scores with (a critic server, and a reward server unless the critic carries the reward model), each ready -> the one
training loop (models/loop.py), its parts as this flow's tasks: an iteration, a held-out eval at 0, every eval.every
and at the end, metrics, a checkpoint every N -> tear everything down.
"""

from __future__ import annotations

from prefect import get_run_logger

from components.serving.services import rollout_server, run_services
from components.tasks import (STEPS, actor_on_ranks, flow_hooks, log_data, reported_failure, run_summary,
                              training_run)
from models.config import RLHFConfig
from models.loop import read_data, run_loop
from models.prepare import prepare_run


def train(config: RLHFConfig) -> dict:
    """Run (or resume) the training run of `config` to its last iteration; returns the run summary. A failure ends the
    flow with the cause's first line as its state message."""
    with reported_failure():
        cfg = prepare_run(config, log=get_run_logger().info)
        prompts, evals = read_data(cfg)  # bad data fails here, before any model loads
        with training_run(cfg) as (session, place), rollout_server(cfg, place, STEPS) as rollout, \
                actor_on_ranks(cfg, session) as actor, run_services(cfg, place, actor, STEPS, rollout) as services:
            log_data(session, prompts, evals)
            history = run_loop(cfg, actor, prompts, evals, flow_hooks(cfg, session, services))
            return run_summary(session, actor, history)
