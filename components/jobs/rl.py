"""What an RL run plugs into the job builder (components/runs.py): PPO, RLOO, GRPO on the actor's ranks.

    prepare    models/prepare.py (what it reads pinned, derived values filled in), the prompts read (models/data.py)
    provenance its record: the training fields of its config, its prompts' rows, its models as pinned, its reward
               and environment files, the code and libraries (and vLLM's version when it samples with vLLM)
    stored     its reward files stored in its store (every process that scores loads them by digest)
    controls   with the actor on several nodes, this process is the run's controller (components/controller.py)
    run        the rollout server when the engine holds its own weights (it loads beside the actor); the actor on its
               ranks, restored from the run's checkpoint (weights, optimizer, RNGs); the run's services: the rollout
               server given the actor's weights, and what the algorithm scores with (a critic server, a reward server
               unless the critic carries the reward model), each ready; the one training loop (models/loop.py)
    publish    the last checkpoint's policy as a Hugging Face model in the run's store and as the MLflow run's model
               (components/export.py)

Where the servers run is the config's `deploy` section; how each named step executes is the caller's `Steps`.
"""

from __future__ import annotations

import random
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from components.controller import control, controls
from components.export import publish_model
from components.jobs import Job
from components.launch.ranks import actor_ranks
from components.serving.auth import ranks_secret
from components.serving.services import RunServices, rollout_server, run_services
from components.storage.backends import CheckpointError
from components.tracking.provenance import (RL_NOT_TRAINED, data_record, job_record, judging_files, model_record,
                                            verifiers_record, vllm_version)
from components.tracking.run import RunSession, store_reward_files, tuple_state
from components.verifiers import rollouts as verifiers
from models.algorithms.recipes import resolved_values
from models.config import RLHFConfig, nested
from models.data import PromptSet
from models.export import export_spec
from models.loop import DIRECT, Iterations, Leader, Steps, read_data, run_loop
from models.prepare import prepare_run
from models.sections import deep_merge

HEADLINE = ("reward", "reward_std", "kl")  # with objective/* and rewards/*: the last iteration's, in a summary


class RL(Job):
    """An RL run (models/config.RLHFConfig)."""

    unit = "iteration"

    def __init__(self):
        super().__init__(RLHFConfig.job)

    def title(self, run_name: str) -> str:
        return f"run {run_name}"

    def prepare(self, cfg: RLHFConfig) -> tuple[RLHFConfig, tuple[PromptSet, PromptSet | None]]:
        cfg = prepare_run(cfg)
        if cfg.environment.verifiers:  # the environment's own datasets
            return cfg, verifiers.prompt_sets(cfg, cfg.eval.max_prompts, evals=bool(cfg.eval.every))
        return cfg, read_data(cfg)  # bad data fails here, before any model loads

    def tags(self, cfg: RLHFConfig) -> dict[str, str]:
        return {"algorithm": cfg.algorithm, "preset": cfg.preset,
                "reward_transport": cfg.reward.transport}

    def provenance(self, cfg: RLHFConfig) -> dict:
        """What it trains from: its prompts' rows (a verifiers environment's own), its models as pinned, its reward
        and environment files; vLLM's version when it samples with vLLM."""
        d = cfg.data
        data = {"prompts": verifiers_record(cfg.environment.verifiers) if cfg.environment.verifiers else
                data_record(cfg.source("data.prompts"), d.split)}
        models = {field.removeprefix("model."): model_record(cfg.source(field)) for field in cfg.reads().models}
        code = {"vllm": vllm_version(cfg.deploy.rollout.python)} if cfg.rollout.engine == "vllm" else None
        return job_record(cfg, cfg.run.model_dump(mode="json", exclude=RL_NOT_TRAINED), models, data,
                          judging_files(cfg), code)

    def controls(self, cfg: RLHFConfig) -> bool:
        return controls(cfg)

    def control(self, cfg: RLHFConfig, steps: Steps = DIRECT) -> dict:
        return control(cfg, steps)

    def stored(self, cfg: RLHFConfig, store) -> tuple[RLHFConfig, dict]:
        """Its reward files stored in its store (reward.files: what every process of the run receives)."""
        return store_reward_files(cfg, store)

    def logged_config(self, cfg: RLHFConfig) -> dict:
        """Its config (the reward files' digests are tags: their paths make no param names) with its loss settings as
        they run (each left unset: its recipe's value)."""
        logged = cfg.model_dump(mode="json", exclude={"reward": {"files"}, "sources": True})
        return deep_merge(logged, nested(resolved_values(cfg)))

    def restore_parts(self, cfg: RLHFConfig) -> tuple[str, ...] | None:
        """launch=kubernetes: the critic server (a pod of its own) restores its part from the store itself."""
        return ("actor",) if cfg.deploy.critic.launch == "kubernetes" else None

    def opened(self, session: RunSession) -> None:
        """A critic is resumed from the checkpoint the actor is, never newer or older."""
        shutil.rmtree(session.critic_dir, ignore_errors=True)
        if session.resumed_from is not None and (session.restore_dir / "critic").exists():
            shutil.copytree(session.restore_dir / "critic", session.critic_dir)

    def run(self, session: RunSession, data, steps: Steps = DIRECT) -> dict:
        cfg, (prompts, evals) = session.cfg, data
        with rollout_server(cfg, session.place, steps) as rollout, actor_on_ranks(cfg, session, steps) as actor, \
                run_services(cfg, session.place, actor, steps, rollout) as services:
            log_data(session, prompts, evals, steps)
            history, evaluations = run_loop(Iterations(cfg, actor, prompts, evals, services.critic, services.reward),
                                            RunRecord(session, services, steps), steps)
            steps.log(f"run {session.name} finished: {actor.state.iteration} iterations on {actor.me.world_size} "
                      f"actor rank(s)")
        final = history[-1] if history else {}
        return {"steps": actor.state.iteration, "iterations": actor.state.iteration, "history": history,
                "evals": evaluations, "metrics": final,
                "final": {k: v for k, v in final.items() if k in HEADLINE or k.startswith(("objective/", "rewards/"))}}

    def publish(self, session: RunSession, result: dict, steps: Steps = DIRECT) -> dict:
        model = publish_model(session, "model.policy")  # the trained model out: store + MLflow
        steps.log(f"model of iteration {model['iteration']}: {model['model']} (MLflow logged model "
                  f"{model['mlflow_model_id']})")
        return model


@contextmanager
def actor_on_ranks(cfg: RLHFConfig, session: RunSession, steps: Steps = DIRECT) -> Iterator[Leader]:
    """The actor on all its ranks, restored from the run's checkpoint; every rank stopped on the way out."""
    with actor_ranks(cfg, session.local_dir / "logs", ranks_secret()) as actor:
        if warning := steps("restore-actor", restore_actor, session, actor):
            steps.log(f"warning: {warning}")
        yield actor


def restore_actor(session: RunSession, actor: Leader) -> str | None:
    """The downloaded checkpoint into the freshly built actor on all its ranks (weights, optimizer, RNGs); returns a
    warning when it was saved by another number of ranks (then the optimizer starts fresh)."""
    warning = session.restore(actor, "actor")
    if session.resumed_from is not None:
        torch.set_rng_state(session.manifest["rng"]["torch"])
        random.setstate(tuple_state(session.manifest["rng"]["python"]))
    return warning


def checkpoint(session: RunSession, actor: Leader, critic_info: dict | None) -> str:
    """The actor (all ranks take part) + the critic of the same iteration (a local save, or a Kubernetes critic's
    upload adopted inside the store) + the manifest with the critic's step and the RNG states."""
    parts, stored = {}, {}
    if critic_info:
        key = session.store.key_of(critic_info["path"])
        if key is not None:
            stored["critic"] = key
        else:
            parts["critic"] = own_critic_save(critic_info["path"], session.critic_dir)
    cfg = session.cfg
    state = {"critic_step": (critic_info or {}).get("step"),
             "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
             "export": export_spec("actor", "causal-lm", cfg.model.dtype, cfg.source("model.policy"))}
    return session.checkpoint(actor, "actor", state, parts=parts, stored=stored)


@dataclass
class RunRecord:
    """What the training loop records an RL run into (models/loop.Record): the run's MLflow run and checkpoint store,
    its calls guarded by the run's services."""

    session: RunSession
    services: RunServices
    steps: Steps

    def guard(self, fn, *args, **kwargs):
        return self.services.guard(fn, *args, **kwargs)

    def log(self, done: list[tuple[int, dict, list[dict]]]) -> None:
        for iteration, metrics, samples in done:
            self.log_iteration(iteration, metrics, samples)

    def log_iteration(self, iteration: int, metrics: dict, samples: list[dict]) -> None:
        """Metrics at step=iteration (one an earlier attempt logged is skipped), a sample table every
        tracking.table_every iterations, a line in the log."""
        session = self.session
        if session.tracker.last_step is None or iteration > session.tracker.last_step:
            session.log_steps([(iteration, metrics)])
            if iteration % session.cfg.tracking.table_every == 0 or iteration == 1:
                session.tracker.log_table(samples, step=iteration)
                if "conversation" in (samples[0] if samples else {}):
                    # an environment run's episodes, whole conversations, beside the run as well (MLflow has them)
                    key = re.sub(r"[^a-z0-9-]+", "-", f"episodes-{session.name}".lower()).strip("-")
                    self.steps.table(key[:128], samples, f"Episodes of iteration {iteration} (run {session.name}): "
                                                         f"turns, tool calls and results, reward")
        m = metrics
        stale = ""  # an engine with its own weights: how far its sampling is from the trainer's logprobs, and why
        if "rollout/staleness_max" in m:
            stale = (f" sampler logp diff {m['sampling/sampling_logp_difference/max']:.1e} "
                     f"staleness {m['rollout/staleness_max']:g}")
        gold = f"gold {m['objective/gold_reward']:+.3f} " if "objective/gold_reward" in m else ""
        tools = (f" tools {m['tools/call_frequency']:.2f}/episode errors {m['env/errors']:g} timeouts "
                 f"{m['env/timeouts']:g}") if "tools/call_frequency" in m else ""
        kl = f"KL {m['objective/kl']:.3f} " if "objective/kl" in m else ""
        self.steps.log(f"iteration {iteration}/{session.cfg.iterations}: {gold}reward {m['reward']:+.3f} "
                       f"{kl}step {m['step_time']:.2f}s{stale}{tools}")

    def log_eval(self, iteration: int, metrics: dict, rows: list[dict]) -> None:
        """An eval's metrics at step=iteration, its samples as an MLflow table and a table beside the run."""
        self.session.log_eval(iteration, metrics, rows)
        text = f"eval at iteration {iteration}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
        key = re.sub(r"[^a-z0-9-]+", "-", f"eval-{self.session.name}".lower()).strip("-")
        self.steps.table(key[:128], rows, f"Held-out {text} (run {self.session.name})")
        self.steps.log(text)

    def checkpoint(self, actor: Leader) -> str:
        """critic_save on the critic, then actor (all ranks) + critic + manifest into the store; `latest` last."""
        critic = self.services.critic
        critic_info = critic.save() if critic is not None else None
        uri = checkpoint(self.session, actor, critic_info)
        self.steps.log(f"checkpoint iteration {actor.state.iteration}: {uri}")
        return uri


def own_critic_save(path: str, critic_dir: Path) -> Path:
    """A local critic_save's directory, uploaded with the checkpoint only when it lies under the run's own critic
    directory (where the run told its critic to save): a critic that names another directory (the run's secrets, the
    cache, another run's) is refused, naming it."""
    resolved, own = Path(path).resolve(), Path(critic_dir).resolve()
    if not resolved.is_relative_to(own):
        raise CheckpointError(f"critic_save answered the directory {path!r}, outside the run's critic directory "
                              f"{own}: refused (a critic saves under it, or into the run's store)")
    return resolved


def log_data(session: RunSession, prompts: PromptSet, evals: PromptSet | None, steps: Steps = DIRECT) -> None:
    """What the run reads: counts in the log and in MLflow (data/rows, data/filtered_rows, eval/rows at step 0)."""
    counts = {"data/rows": len(prompts), "data/filtered_rows": prompts.filtered,
              "data/truncated_rows": prompts.truncated}
    note = f"data: {len(prompts)} prompts from {prompts.source}"
    if prompts.filtered or prompts.truncated:
        note += (f" ({prompts.filtered} filtered, {prompts.truncated} truncated: longer than "
                 f"data.max_prompt_length={session.cfg.data.max_prompt_length})")
    if evals is not None:
        counts.update({"eval/rows": len(evals), "eval/filtered_rows": evals.filtered})
        note += f"; eval: {len(evals)} prompts from {evals.source}"
    session.log_data(counts, note, steps.log)
