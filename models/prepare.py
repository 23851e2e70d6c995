"""What a run derives from its config, computed once at the entry point and carried with the run.

`prepare_run(cfg)` is the one explicit place that pins what a run reads before any weights load (models/resolve.pin:
each model and data source resolved once, a missing one failing naming its field: a path, a hub id in the Hugging
Face cache, an s3:// prefix fetched into this machine's cache, or the embedded default `tiny/...` shipped with the
package; a config that carries its pins already, as the ranks, servers and node groups receive it, resolves
nothing); the models not given follow the policy's family (model.reward: the family's own or required; model.critic: the
reward model when it shares the policy's tokenizer, else the policy), and every model that reads the policy's token ids
(the critic, a reward model on the token transport, on-policy distillation's teacher) shares the policy's tokenizer
(tokenizers only: nothing heavy loads).
It also fills in the LR schedule lengths, decides the reward transport ('auto' -> 'tokens' or 'text'), makes reward
files and the state directory absolute. Every entry point calls it (`rlhf train`, the training flows, the server
children and `rlhf serve`); what it returns is the config the actor's ranks, the servers and the tracker receive, so
nobody derives these facts again.
"""

from __future__ import annotations

from pathlib import Path

from models.algorithms import ALGORITHMS
from models.config import RLHFConfig, merge, with_schedule_lengths
from models.data import DataError
from models.resolve import pin
from models.reward import load_reward_tokenizer, same_tokenizer
from models.specs import absolute_spec
from models.tiny_files import is_tiny_policy

FAMILY_REWARD = "tiny/reward"  # the reward model of the embedded tiny policy's family


def prepare_run(cfg: RLHFConfig) -> RLHFConfig:
    """The config with its derived values filled in (idempotent: a prepared config comes back unchanged)."""
    cfg = merge(cfg, {**family_reward(cfg), **absolute_reward_files(cfg)})
    cfg = pin(cfg)
    check_reward_model(cfg)
    if not cfg.data.prompts and not cfg.environment.verifiers:  # a verifiers environment brings its dataset
        raise DataError("data.prompts: not set; name the training prompts (a local file or folder, a hub data set "
                        "id, or builtin:<task>: models/data.py)")
    cfg = pin(merge(cfg, critic_source(cfg)))  # a critic initialised from the policy shares the policy's pin
    check_tokenizers(cfg)
    cfg = with_schedule_lengths(cfg)
    return merge(cfg, {"deploy.state_dir": str(cfg.resolved_state_dir()), "reward.transport": reward_transport(cfg)})


def family_reward(cfg: RLHFConfig) -> dict:
    """model.reward left unset follows the policy's family: the embedded tiny policy's own reward model."""
    return {"model.reward": FAMILY_REWARD} if cfg.model.reward is None and is_tiny_policy(cfg.model.policy) else {}


def absolute_reward_files(cfg: RLHFConfig) -> dict:
    """Reward functions and environments given as files ('path/to/rewards.py:fn') with their path made absolute, so
    every process of the run (a server's working directory may be another) loads the same file."""
    r = cfg.reward
    out = {name: absolute_spec(value) for name, value in (("reward.function", r.function), ("reward.gold", r.gold))
           if value and absolute_spec(value) != value}
    if r.functions and [absolute_spec(s) for s in r.functions] != r.functions:
        out["reward.functions"] = [absolute_spec(s) for s in r.functions]
    factory = cfg.environment.factory  # environment classes given as files, the same way
    if isinstance(factory, str) and absolute_spec(factory) != factory:
        out["environment.factory"] = absolute_spec(factory)
    elif isinstance(factory, dict) and {k: absolute_spec(v) for k, v in factory.items()} != factory:
        out["environment.factory"] = {k: absolute_spec(v) for k, v in factory.items()}
    v = cfg.environment.verifiers  # the folders of its environment's module, the same way
    if v and [str(Path(p).expanduser().absolute()) for p in v.paths] != v.paths:
        out["environment.verifiers.paths"] = [str(Path(p).expanduser().absolute()) for p in v.paths]
    template = cfg.environment.chat_template
    if template and template.endswith(".jinja") and not Path(template).is_absolute():
        out["environment.chat_template"] = str(Path(template).expanduser().absolute())
    return out


def check_reward_model(cfg: RLHFConfig) -> None:
    """A reward model that is needed and not given fails, naming the field."""
    if cfg.reward.source == "model" and not cfg.model.reward:
        raise ValueError(f"model.reward: not set, and reward.source='model' needs a reward model for the policy "
                         f"'{cfg.model.policy}' (a sequence-classification checkpoint with one label); or score "
                         f"with Python functions: reward.source=function, reward.function=path/to/rewards.py:fn")


def critic_source(cfg: RLHFConfig) -> dict:
    """model.critic left unset, for an algorithm with a critic: initialised from the reward model when it shares the
    policy's tokenizer (NeMo-Aligner: critic and reward model read the same ids), else from the policy itself (veRL,
    OpenRLHF: the actor's checkpoint with a new value head), since the critic reads the policy's tokens."""
    if cfg.model.critic or not ALGORITHMS[cfg.algorithm].needs_critic:
        return {}
    if cfg.reward.source == "model":
        policy = load_reward_tokenizer(cfg.local_path("model.policy"), "model.policy")
        if same_tokenizer(policy, load_reward_tokenizer(cfg.local_path("model.reward"))):
            return {}
    return {"model.critic": cfg.model.policy}


def check_tokenizers(cfg: RLHFConfig) -> None:
    """The models that read the policy's token ids share its tokenizer: the critic (an algorithm with one), and the
    reward model when reward.transport is 'tokens'. A mismatch fails here, naming the field, instead of an
    out-of-range index inside the model later. Tokenizers only: no weights load."""
    readers = []
    if ALGORITHMS[cfg.algorithm].needs_critic and cfg.model.critic and cfg.model.critic != cfg.model.policy:
        readers.append(("model.critic", cfg.model.critic, "the critic reads the policy's token ids",
                        "give a critic of the policy's family, or leave model.critic unset to initialise it from "
                        "the policy"))
    if cfg.reward.source == "model" and cfg.reward.transport == "tokens":
        readers.append(("model.reward", cfg.model.reward, "reward.transport='tokens' sends it the policy's token ids",
                        "set reward.transport to 'auto' or 'text' (the reward model tokenizes the text itself)"))
    if ALGORITHMS[cfg.algorithm].needs_teacher and cfg.model.teacher:
        readers.append(("model.teacher", cfg.model.teacher, "the teacher scores the student's own token ids",
                        "give a teacher of the policy's family (the same tokenizer)"))
    if not readers:
        return
    policy = load_reward_tokenizer(cfg.local_path("model.policy"), "model.policy")
    for field, value, why, fix in readers:
        path = cfg.local_path(field)
        try:
            reader = load_reward_tokenizer(path, field)
        except (OSError, RuntimeError, ValueError):  # a checkpoint without tokenizer files (a saved critic)
            from transformers import AutoConfig  # light next to the models: a config file

            vocab = getattr(AutoConfig.from_pretrained(path), "vocab_size", None)
            if vocab is not None and vocab < len(policy):
                raise ValueError(f"{field}: '{value}' has a vocabulary of {vocab} ids, the policy's tokenizer "
                                 f"('{cfg.model.policy}') {len(policy)}; {why}: {fix}") from None
            continue
        if not same_tokenizer(policy, reader):
            raise ValueError(f"{field}: '{value}' does not share the policy's tokenizer ('{cfg.model.policy}': "
                             f"{len(reader)} vs {len(policy)} tokens, or other ids for them); {why}: {fix}")


def reward_transport(cfg: RLHFConfig, reader: str | None = None) -> str:
    """'text' when the reward model reads text with its own tokenizer, 'tokens' when it shares the ids of the
    rollouts (reward.transport, or for 'auto' a comparison of the two tokenizers). The rollouts' tokenizer is the
    policy's; `reader` names another model that reads them (a critic server started on its own knows no policy: its
    critic, or the reward model it is initialised from).

    An algorithm with a critic and no `model.critic` initialises the critic from the reward model, and the critic
    reads the policy's tokens: a reward model with another tokenizer is refused then, naming the field to set
    (prepare_run sets model.critic to the policy first: `critic_source`).
    """
    critic_from_reward = reader is None and ALGORITHMS[cfg.algorithm].needs_critic and not cfg.model.critic
    if cfg.reward.source == "function" or (cfg.reward.transport != "auto" and not critic_from_reward):
        return "tokens" if cfg.reward.transport == "auto" else cfg.reward.transport  # a function decodes tokens itself
    rollouts = load_reward_tokenizer(cfg.local_path("model.policy" if reader is None else reader),
                                     "model.policy" if reader is None else reader)
    reward = load_reward_tokenizer(cfg.local_path("model.reward"))
    shared = same_tokenizer(rollouts, reward)
    if critic_from_reward and not shared:
        raise ValueError(f"model.critic: not set, so the critic would be initialised from model.reward "
                         f"'{cfg.model.reward}', whose tokenizer differs from the policy's; the critic reads the "
                         f"policy's tokens: give a critic that shares the policy's tokenizer (e.g. tiny/critic)")
    if cfg.reward.transport != "auto":
        return cfg.reward.transport
    return "tokens" if shared else "text"
