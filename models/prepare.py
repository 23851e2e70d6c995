"""What a run derives from its config, computed once at the entry point and carried with the run.

`prepare_run(cfg)` is the one explicit place that builds the embedded default models a config names (`tiny/...`,
once per state directory, under a lock: models/tiny.py), fills in the LR schedule lengths, decides the reward
transport ('auto' -> 'tokens' or 'text') and makes the state directory absolute. Every entry point calls it (`rlhf
train`, the training flows, the server children and `rlhf serve`); what it returns is the config the actor's ranks,
the servers and the tracker receive, so nobody derives these facts again.
"""

from __future__ import annotations

from pathlib import Path

from models.algorithms import ALGORITHMS
from models.config import TINY_PREFIX, RLHFConfig, merge, with_schedule_lengths
from models.loading import check_model_path
from models.reward import load_reward_tokenizer, same_tokenizer
from models.tiny import ensure_tiny


def prepare_run(cfg: RLHFConfig, log=print) -> RLHFConfig:
    """The config with its derived values filled in (idempotent: a prepared config comes back unchanged)."""
    build_embedded_models(cfg, log=log)
    cfg = with_schedule_lengths(cfg)
    return merge(cfg, {"state_dir": str(cfg.resolved_state_dir()), "reward.transport": reward_transport(cfg)})


def build_embedded_models(cfg: RLHFConfig, fields: tuple[str, ...] = ("policy", "reward", "critic"), log=print) -> None:
    """Build the `tiny/<name>` models that the `model.<field>`s this process loads name and the state directory
    lacks (a path that exists wins). A path the user gave that does not exist fails first, naming its field, before
    anything is built."""
    given = {field: getattr(cfg.model, field) for field in fields if getattr(cfg.model, field)}
    named = [value for value in given.values() if value.startswith(f"{TINY_PREFIX}/") and not Path(value).exists()]
    for field, value in given.items():
        if value not in named:
            check_model_path(cfg.resolve_model_path(value), f"model.{field}")
    if named:
        ensure_tiny(cfg.resolved_state_dir() / "models" / TINY_PREFIX, names=[v.split("/", 1)[1] for v in named], log=log)


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
