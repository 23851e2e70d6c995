"""The frame every training flow shares, read top to bottom:

prepare the run (models/prepare.py) -> open or resume it, start the actor on its ranks -> deploy the servers of the
run and wait until they are ready: the rollout server when the engine holds its own weights (given the actor's
weights), and what the algorithm scores with (a critic server, and a reward server unless the critic carries the
reward model) -> iterate: one task per iteration, metrics, a checkpoint every N -> tear everything down.
"""

from __future__ import annotations

from components.serving.services import scoring_services
from components.tasks import (iteration_task, log_metrics, reported_failure, run_summary, save_checkpoint,
                              training_run)
from models.config import RLHFConfig
from models.loop import batch_size, load_prompts, prompt_batches
from models.prepare import prepare_run


def train(config: RLHFConfig) -> dict:
    """Run (or resume) the training run of `config` to its last iteration; returns the run summary. A failure ends the
    flow with the cause's first line as its state message."""
    with reported_failure():
        cfg = prepare_run(config)
        step = iteration_task(cfg)
        with training_run(cfg) as (session, actor), scoring_services(cfg, session, actor) as scoring:
            batches = prompt_batches(load_prompts(cfg), batch_size(cfg), cfg.seed, start_batch=actor.state.iteration)
            metrics = {}
            while actor.state.iteration < cfg.iterations:
                metrics, samples = scoring.guard(step, actor, next(batches), scoring.critic, scoring.reward)
                log_metrics(session, actor.state.iteration, metrics, samples)
                if actor.state.iteration % cfg.checkpoint.every == 0 or actor.state.iteration == cfg.iterations:
                    scoring.guard(save_checkpoint, session, actor, scoring.critic)
            return run_summary(session, actor, metrics)
