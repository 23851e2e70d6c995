"""REINFORCE/RLOO as a Prefect flow: start the actor's ranks, deploy the reward server, wait until ready, iterate;
no critic stage."""

from __future__ import annotations

from prefect import flow

from components.services import reward_service
from components.tasks import log_metrics, rloo_iteration, run_summary, save_checkpoint, training_run
from models.config import RLHFConfig, with_schedule_lengths
from models.loop import load_prompts, prompt_batches


@flow(name="reinforce", log_prints=True)
def reinforce(config: RLHFConfig = RLHFConfig(algorithm="rloo")) -> dict:
    """Train the actor with RLOO: k rollouts per prompt scored by the reward server, leave-one-out baseline."""
    cfg = with_schedule_lengths(config.model_copy(update={"algorithm": "rloo"}))
    with training_run(cfg) as (session, actor), reward_service(cfg, session) as reward:
        batches = prompt_batches(load_prompts(cfg), cfg.reinforce.rollout_batch_size, cfg.seed,
                                 start_batch=actor.state.iteration)
        metrics = {}
        while actor.state.iteration < cfg.iterations:
            metrics, samples = reward.guard(rloo_iteration, actor, next(batches), reward.backend)
            log_metrics(session, actor.state.iteration, metrics, samples)
            if actor.state.iteration % cfg.checkpoint.every == 0 or actor.state.iteration == cfg.iterations:
                save_checkpoint(session, actor)
        return run_summary(session, actor, metrics)
