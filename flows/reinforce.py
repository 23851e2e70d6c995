"""REINFORCE/RLOO as a Prefect flow: start the actor's ranks, deploy the reward server, wait until ready, iterate;
no critic stage."""

from __future__ import annotations

from prefect import flow

from components.ranks import actor_ranks
from components.services import reward_service
from components.tasks import (log_metrics, open_run, reported_failure, restore_actor, rloo_iteration, run_summary,
                              save_checkpoint)
from flows.ppo import run_tags
from models.config import RLHFConfig, with_schedule_lengths
from models.loop import load_prompts, prompt_batches


@flow(name="reinforce", log_prints=True)
def reinforce(config: RLHFConfig = RLHFConfig(algorithm="rloo")) -> dict:
    """Train the actor with RLOO: k rollouts per prompt scored by the reward server, leave-one-out baseline."""
    cfg = with_schedule_lengths(config.model_copy(update={"algorithm": "rloo"}))
    with reported_failure():
        session = open_run(cfg, run_tags())
        status = "FAILED"
        try:
            with actor_ranks(cfg, session.local_dir / "logs") as actor:
                restore_actor(session, actor)
                with reward_service(cfg, session) as reward:
                    batches = prompt_batches(load_prompts(cfg), cfg.reinforce.rollout_batch_size, cfg.seed,
                                             start_batch=actor.state.iteration)
                    metrics = {}
                    while actor.state.iteration < cfg.iterations:
                        metrics, samples = reward.guard(rloo_iteration, actor, next(batches), reward.backend)
                        log_metrics(session, actor.state.iteration, metrics, samples)
                        if actor.state.iteration % cfg.checkpoint.every == 0 or actor.state.iteration == cfg.iterations:
                            save_checkpoint(session, actor)
            status = "FINISHED"
            return run_summary(session, actor, metrics)
        finally:
            session.close(status)
