"""Every kind of job, declared once: its name, its command, what it does, its config classes and what trains it.
Everything else that names a kind is derived from here: the CLI's commands and `rlhf config --describe`, the
flows and their deployments (flows/stages.py, flows/serve.py, the local stack), the job builder's registry
(components/runs.py), the stages' config and trainer registries (models/stages/), the pipeline's cache prefixes,
task names and registered model names, the metric groups. Light: names and import paths only (the CLI's parser
reads it without loading a model library); `load` imports what a path names when it is used.

A new stage is a `JobKind` here, its config section and run configs (models/stages/config.py), its trainer (a
`StageKind`, models/stages/) and its loss (models/losses.py); docs/contributing.md walks through one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class JobKind:
    """One kind of job."""

    job: str  # the configs' `job`, a stage's config section and the pipeline's stage name ('reward_model')
    command: str  # `rlhf <command>`, the flow '<command>' and its deployment '<command>/default', the prefix of its
    # run names and cached stage directories ('reward-model')
    summary: str  # what it does: the CLI's help, the deployment's description
    config: Optional[str] = None  # 'module:Class' of its flow's `config` parameter (None: RL's flows are their own)
    run: Optional[str] = None  # 'module:Class' of its config with `deploy`, as its processes receive it
    trainer: Optional[str] = None  # 'module:Class' of the StageKind its ranks train (None: not a stage on the ranks)
    registered_as: Optional[str] = None  # a pipeline registers its model as '<register_as>-<registered_as>'
    publishes: bool = True  # ends by publishing the model it trained (an eval trains none: it only measures)
    metrics: tuple[tuple, ...] = ()  # metrics only it logs: (names, what, TRL's name) each (models/metrics.Metric)
    policy_from_sft: bool = False  # a pipeline may train its policy with it from the SFT model, its frozen reference
    # (a section of that name: sft -> <job> -> eval, instead of reward_model and rl)

    @property
    def trains_on_ranks(self) -> bool:
        return self.trainer is not None

    @property
    def run_class(self) -> type:
        """Its config as its processes receive it (with `deploy`), imported when asked for."""
        return load(self.run)

    @property
    def config_class(self) -> type:
        """Its flow's `config` parameter, imported when asked for."""
        return load(self.config)

    @property
    def section_class(self) -> type:
        """The class of its own config section (the `<job>` field of its config), imported when asked for."""
        return self.config_class.model_fields[self.job].annotation


def load(path: str):
    """The object a 'module:name' path names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


KINDS: tuple[JobKind, ...] = (
    JobKind("rl", "rl", "an RL run: PPO or a critic-free recipe (rlhf train, ppo/default, reinforce/default)",
            run="models.config:RLHFConfig", registered_as="policy"),
    JobKind("sft", "sft", "supervised fine-tuning on completions (TRL's prompt/completion or messages rows)",
            "models.stages.config:SFTRunConfig", "models.stages.config:SFTRun", "models.stages.train:SFT", "sft"),
    JobKind("reward_model", "reward-model", "a Bradley-Terry reward model on preference pairs (prompt, chosen, "
            "rejected)", "models.stages.config:RewardModelRunConfig", "models.stages.config:RewardModelRun",
            "models.stages.train:RewardModel", "reward-model"),
    JobKind("dpo", "dpo", "direct preference optimisation on preference pairs (prompt, chosen, rejected), against "
            "the frozen model it starts from", "models.stages.config:DPORunConfig", "models.stages.config:DPORun",
            "models.stages.dpo:DPO", "policy", policy_from_sft=True),
    JobKind("kto", "kto", "KTO on completions labelled desirable or undesirable (or preference pairs, unpaired), "
            "against the frozen model it starts from", "models.stages.kto:KTORunConfig", "models.stages.kto:KTORun",
            "models.stages.kto:KTO", "policy", policy_from_sft=True, metrics=(
                (("train/kl", "eval/kl"), "KTO: the KL term z0 of its loss, the policy's KL to its reference on "
                 "mismatched (prompt, completion) pairs of the batch (held out: of all held-out rows), clamped at 0.",
                 "kl"),)),
    JobKind("eval", "eval", "a policy against a reference policy on held-out prompts, judged by a reward model and a "
            "gold reward", "models.stages.config:EvalRunConfig", "models.stages.config:EvalRun", publishes=False),
)
BY_JOB: dict[str, JobKind] = {kind.job: kind for kind in KINDS}
JOBS_BUT_RL: tuple[JobKind, ...] = tuple(kind for kind in KINDS if kind.job != "rl")  # each with its own command
STAGES: tuple[str, ...] = tuple(kind.job for kind in KINDS if kind.trains_on_ranks)  # trained on the actor's ranks
# a pipeline's other stages
POLICY_FROM_SFT: tuple[str, ...] = tuple(kind.job for kind in KINDS if kind.policy_from_sft)
