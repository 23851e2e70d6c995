"""The `rlhf models tiny`, `rlhf config` and `rlhf train` commands, and the config the CLI flags name."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from components.cli.files import load_cli_config
from components.pipeline.config import PipelineFile
from components.cli.progress import ProgressSteps
from components.runs import train
from components.sweep.config import SweepConfig
from components.sweep.experiment import ExperimentConfig
from models.config import RLHFConfig, describe
from models.deploy import DeployConfig
from models.kinds import JOBS_BUT_RL
from models.tiny import build_tiny


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


def named_values(tree) -> dict[str, str]:
    """Each dotted field of `tree` a preset or a placement sets, and what each sets it to ('; tiny preset 16')."""
    out: dict[str, str] = {}
    for cls, prefix in ((RLHFConfig, ""), (DeployConfig, "" if isinstance(tree, DeployConfig) else "deploy.")):
        if isinstance(tree, cls) or (cls is DeployConfig and "deploy" in type(tree).model_fields):
            for name, values in cls.named_values.items():
                for key, value in values.items():
                    out[prefix + key] = out.get(prefix + key, "") + f"; {name} {cls.named} {value!r}"
    return out


def cmd_config(args) -> int:
    """The resolved config as YAML, or with --describe [WHAT] every field of a config tree (a run's by default; a
    deployment's, a pipeline's, a stage's, an eval's, a sweep's) with its type, default, the values presets and
    placements give it, and its description."""
    if args.describe:
        tree = described(args.describe)
        named = named_values(tree)
        for field, kind, default, description in describe(tree, advanced=args.all):
            print(f"{field}:" if kind == "section" else f"{field}  ({kind}, default {default}{named.get(field, '')})")
            print(f"    {description}")
        return 0
    cfg = load_cli_config(args)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return 0


def cmd_train(args) -> int:
    """A training run in this process, through the same job builder as a flow run (components/runs.py): it
    checkpoints, resumes by run_name, logs to MLflow (the local stack's server when `rlhf up` runs, else the state
    directory's store) and runs the held-out eval. Its critic and reward model run in this process unless another
    placement is named (--placement local: servers as child processes). With no config at all (no --config, --set or
    --preset) it runs the embedded demo: --preset tiny."""
    if not (args.config or args.set or args.preset):
        args.preset = "tiny"
        print("rlhf train: no config given: the embedded demo on the tiny models (--preset tiny)")
    steps = ProgressSteps()  # a progress bar of the iterations with the time left, the run's messages above it
    try:
        result = train(load_cli_config(args), steps)
    finally:
        steps.close()
    if args.metrics_out:
        Path(args.metrics_out).write_text(json.dumps(result["history"], indent=1))
    if args.eval_out:
        Path(args.eval_out).write_text(json.dumps(result["evals"], indent=1))
    if args.summary_out:
        Path(args.summary_out).write_text(json.dumps(result, indent=1))
    return 0
