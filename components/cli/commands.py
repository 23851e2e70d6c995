"""The `rlhf models tiny`, `rlhf config` and `rlhf train` commands, and the config the CLI flags name."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from components.cli.options import parse_overrides
from components.pipeline.config import PipelineFile
from components.cli.progress import ProgressSteps
from components.runs import train
from components.sweep.config import SweepConfig
from components.sweep.experiment import ExperimentConfig
from models.config import PRESETS, RLHFConfig, describe, load_config
from models.deploy import DeployConfig
from models.kinds import JOBS_BUT_RL
from models.tiny import build_tiny

# Where `rlhf train`'s parts run unless its config says otherwise: the critic and reward model in this process (no
# servers to start: the quickest way to see a run learn); the rollout server, for rollout.engine=vllm, a local child.
TRAIN_DEPLOY = {"deploy.critic.launch": "in_process", "deploy.reward.launch": "in_process",
                "deploy.rollout.launch": "local"}


def load_cli_config(args, overrides: dict | None = None, defaults: dict | None = None):
    """The config of `--config`, `--preset` and `--set` (or already parsed `overrides`), over the command's own
    `defaults`; exits naming a bad field."""
    try:
        return load_config(args.config, args.preset, overrides if overrides is not None else parse_overrides(args.set),
                           defaults=defaults)
    except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError names the field; YAML and file errors too
        raise SystemExit(f"invalid config: {exc}") from None


def cmd_models_tiny(args) -> int:
    info = build_tiny(args.out, seed=args.seed)
    print(json.dumps(info, indent=2))
    return 0


def described(what: str):
    """The config tree `rlhf config --describe WHAT` prints: a default instance of it."""
    if what == "run":
        return RLHFConfig()
    if what == "sweep":
        return SweepConfig.model_construct(name="<name>", space={})
    if what == "experiment":
        return ExperimentConfig.model_construct(name="<name>", arms={})
    by_command = {kind.command: kind.run_class for kind in JOBS_BUT_RL}
    return {"deploy": DeployConfig, "pipeline": PipelineFile, **by_command}[what]()


def cmd_config(args) -> int:
    """The resolved config as YAML, or with --describe [WHAT] every field of a config tree (a run's by default; a
    deployment's, a pipeline's, a stage's, an eval's, a sweep's) with its type, default and description."""
    if args.describe:
        tiny = PRESETS["tiny"]() if args.describe == "run" else {}
        for field, kind, default, description in describe(described(args.describe), advanced=args.all):
            preset = f"; tiny preset {tiny[field]!r}" if field in tiny else ""
            print(f"{field}:" if kind == "section" else f"{field}  ({kind}, default {default}{preset})")
            print(f"    {description}")
        return 0
    cfg = load_cli_config(args)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return 0


def cmd_train(args) -> int:
    """A training run in this process, through the same job builder as a flow run (components/runs.py): it
    checkpoints, resumes by run_name, logs to MLflow (the local stack's server when `rlhf up` runs, else the state
    directory's store) and runs the held-out eval. Its critic and reward model run in this process unless
    `--set deploy.critic.launch=local` (etc.) says otherwise."""
    steps = ProgressSteps()  # a progress bar of the iterations with the time left, the run's messages above it
    try:
        result = train(load_cli_config(args, defaults=TRAIN_DEPLOY), steps)
    finally:
        steps.close()
    if args.metrics_out:
        Path(args.metrics_out).write_text(json.dumps(result["history"], indent=1))
    if args.eval_out:
        Path(args.eval_out).write_text(json.dumps(result["evals"], indent=1))
    if args.summary_out:
        Path(args.summary_out).write_text(json.dumps(result, indent=1))
    return 0
