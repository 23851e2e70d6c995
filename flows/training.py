"""The frame every training flow shares, read top to bottom:

prepare the run (models/prepare.py) and read its data (models/data.py) -> open or resume it, start the actor on its
ranks -> deploy the servers of the run and wait until they are ready: the rollout server when the engine holds its
own weights (given the actor's weights), and what the algorithm scores with (a critic server, and a reward server
unless the critic carries the reward model) -> iterate: one task per iteration, metrics, a checkpoint every N; a
held-out eval at 0, every eval.every and at the end -> tear everything down.
"""

from __future__ import annotations

from components.serving.services import scoring_services
from components.tasks import (held_out_eval, iteration_task, log_data, log_metrics, reported_failure, run_summary,
                              save_checkpoint, training_run)
from models.config import RLHFConfig
from models.data import PromptStream
from models.eval import is_eval_iteration
from models.loop import batch_size, read_data
from models.prepare import prepare_run


def train(config: RLHFConfig) -> dict:
    """Run (or resume) the training run of `config` to its last iteration; returns the run summary. A failure ends the
    flow with the cause's first line as its state message."""
    with reported_failure():
        cfg = prepare_run(config)
        prompts, evals = read_data(cfg)  # bad data fails here, before any model loads
        step = iteration_task(cfg)
        with training_run(cfg) as (session, actor), scoring_services(cfg, session, actor) as scoring:
            log_data(session, prompts, evals)
            # a resumed run goes on with the rows after the checkpoint's
            stream = PromptStream.resume(prompts, batch_size(cfg), cfg.seed, actor.state.data, actor.state.iteration)
            start, metrics = actor.state.iteration, {}
            while actor.state.iteration < cfg.iterations:
                i = actor.state.iteration
                if evals is not None and is_eval_iteration(cfg, i) and (i == 0 or i != start):
                    scoring.guard(held_out_eval, session, actor, evals, scoring.critic, scoring.reward, i)
                batch = next(stream)
                metrics, samples = scoring.guard(step, actor, batch, stream.state(), scoring.critic, scoring.reward)
                log_metrics(session, actor.state.iteration, metrics, samples)
                if actor.state.iteration % cfg.checkpoint.every == 0 or actor.state.iteration == cfg.iterations:
                    scoring.guard(save_checkpoint, session, actor, scoring.critic)
            if evals is not None and start < cfg.iterations:
                scoring.guard(held_out_eval, session, actor, evals, scoring.critic, scoring.reward, cfg.iterations)
            return run_summary(session, actor, metrics)
