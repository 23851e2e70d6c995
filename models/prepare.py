"""What a run derives from its config, computed once at the entry point and carried with the run.

`prepare_run(cfg)` is the one explicit place that checks the models a config names exist (a path, a cached hub id or
the embedded default `tiny/...` shipped with the package), fills in the LR schedule lengths, decides the reward
transport ('auto' -> 'tokens' or 'text') and makes the state directory absolute. Every entry point calls it (`rlhf
train`, the training flows, the server children and `rlhf serve`); what it returns is the config the actor's ranks,
the servers and the tracker receive, so nobody derives these facts again.
"""

from __future__ import annotations

from models.algorithms import ALGORITHMS
from models.config import RLHFConfig, merge, with_schedule_lengths
from models.loading import check_model_path
from models.reward import load_reward_tokenizer, same_tokenizer


def prepare_run(cfg: RLHFConfig) -> RLHFConfig:
    """The config with its derived values filled in (idempotent: a prepared config comes back unchanged)."""
    check_models(cfg)
    cfg = with_schedule_lengths(cfg)
    return merge(cfg, {"deploy.state_dir": str(cfg.resolved_state_dir()), "reward.transport": reward_transport(cfg)})


def check_models(cfg: RLHFConfig, fields: tuple[str, ...] = ("policy", "reward", "critic")) -> None:
    """Every model a `model.<field>` names exists, before anything loads; the first that does not fails, naming its
    field."""
    for field in fields:
        if value := getattr(cfg.model, field):
            try:
                check_model_path(cfg.resolve_model_path(value), f"model.{field}")
            except FileNotFoundError as exc:
                raise FileNotFoundError(f"model.{field}: {exc}" if not str(exc).startswith("model.") else str(exc)) from None


def reward_transport(cfg: RLHFConfig, reader: str | None = None) -> str:
    """'text' when the reward model reads text with its own tokenizer, 'tokens' when it shares the ids of the
    rollouts (reward.transport, or for 'auto' a comparison of the two tokenizers). The rollouts' tokenizer is the
    policy's; `reader` names another model that reads them (a critic server started on its own knows no policy: its
    critic, or the reward model it is initialised from).

    An algorithm with a critic and no `model.critic` initialises the critic from the reward model, and the critic
    reads the policy's tokens: a reward model with another tokenizer is refused then, naming the field to set.
    """
    critic_from_reward = reader is None and ALGORITHMS[cfg.algorithm].needs_critic and not cfg.model.critic
    if cfg.reward.source == "function" or (cfg.reward.transport != "auto" and not critic_from_reward):
        return "tokens" if cfg.reward.transport == "auto" else cfg.reward.transport  # a function decodes tokens itself
    rollouts = load_reward_tokenizer(cfg.resolve_model_path(reader or cfg.model.policy),
                                     "model.policy" if reader is None else "model.critic")
    reward = load_reward_tokenizer(cfg.resolve_model_path(cfg.model.reward))
    shared = same_tokenizer(rollouts, reward)
    if critic_from_reward and not shared:
        raise ValueError(f"model.critic: not set, so the critic would be initialised from model.reward "
                         f"'{cfg.model.reward}', whose tokenizer differs from the policy's; the critic reads the "
                         f"policy's tokens: give a critic that shares the policy's tokenizer (e.g. tiny/critic)")
    if cfg.reward.transport != "auto":
        return cfg.reward.transport
    return "tokens" if shared else "text"
