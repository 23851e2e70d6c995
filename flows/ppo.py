"""PPO as a Prefect flow: start the actor's ranks, deploy the critic server, wait until ready, iterate, checkpoint,
tear everything down."""

from __future__ import annotations

from prefect import flow

from components.services import critic_service, reward_service
from components.tasks import log_metrics, ppo_iteration, run_summary, save_checkpoint, training_run
from models.config import RLHFConfig, with_schedule_lengths
from models.loop import load_prompts, prompt_batches


@flow(name="ppo", log_prints=True)
def ppo(config: RLHFConfig = RLHFConfig(algorithm="ppo")) -> dict:
    """Train the actor with PPO against a critic server (values, and rewards when the reward model is combined)."""
    cfg = with_schedule_lengths(config.model_copy(update={"algorithm": "ppo"}))
    with training_run(cfg) as (session, actor), critic_service(cfg, session) as critic, \
            reward_service(cfg, session, needed=not cfg.critic.combine_reward) as reward:
        batches = prompt_batches(load_prompts(cfg), cfg.ppo.rollout_batch_size, cfg.seed, start_batch=actor.state.iteration)
        metrics = {}
        while actor.state.iteration < cfg.iterations:
            metrics, samples = critic.guard(ppo_iteration, actor, next(batches), critic.backend,
                                            reward.backend if reward else critic.reward)
            log_metrics(session, actor.state.iteration, metrics, samples)
            if actor.state.iteration % cfg.checkpoint.every == 0 or actor.state.iteration == cfg.iterations:
                critic.guard(save_checkpoint, session, actor, critic.backend)
        return run_summary(session, actor, metrics)
