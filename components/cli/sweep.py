"""`rlhf sweep`: check the sweep here (bad input is refused before anything starts), then run the sweep flow
(flows/sweep.py) in a child process of this shell, in the foreground; its trials are runs of the training deployment
on the Prefect server of the active profile, or of the local stack (`rlhf up`) when none is configured."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml
from prefect.settings import PREFECT_API_URL
from pydantic import ValidationError

from components.cli.files import load_cli_config
from components.cli.options import parse_overrides
from components.cli.files import load_tree
from components.pipeline.config import PipelineFile
from components.launch.processes import project_env
from components.launch.stack import prefect_env
from components.sweep.config import SweepConfig
from components.sweep.space import SweepError, check_sweep
from models.config import RLHFConfig, RunConfig, merge, nested
from models.kinds import KINDS
from models.deploy import DeployConfig

# keys of a pipeline's file that a run's config has not: its base model and its section of each kind of job that a
# run's config has no section of (both have an `eval`)
PIPELINE_ONLY = {"base_model", *({kind.job for kind in KINDS} - set(RunConfig.model_fields))}


class NumberLoader(yaml.SafeLoader):
    """YAML that reads 1e-5 as a number, as JSON does (PyYAML's floats need a dot: '1e-5' would be a string, and a
    categorical of strings)."""


NumberLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                   list("-+0123456789."))


def load_sweep(args) -> SweepConfig:
    """The sweep section of --sweep YAML, then --space FIELD=VALUES and the other flags; exits naming a bad field."""
    data = {}
    if args.sweep:
        data = yaml.load(Path(args.sweep).read_text(), NumberLoader) or {}
        if not isinstance(data, dict):
            raise SystemExit(f"invalid sweep: {args.sweep} must hold a mapping, got {type(data).__name__}")
    for item in args.space or []:
        field, equals, values = item.partition("=")
        if not equals:
            raise SystemExit(f"invalid sweep: --space expects FIELD=VALUES, got {item!r}")
        data.setdefault("space", {})[field.strip()] = yaml.load(values, NumberLoader)
    for name in SweepConfig.model_fields:
        if (value := getattr(args, f"sweep_{name}", None)) is not None:
            data[name] = value
    try:
        return SweepConfig.model_validate(data)
    except ValidationError as exc:
        raise SystemExit(f"invalid sweep: {exc}") from None


def is_pipeline(path: str | None) -> bool:
    """Whether a --config file holds a pipeline (components/pipeline/config.py) rather than a run's config."""
    data = yaml.safe_load(Path(path).read_text()) if path else None
    return isinstance(data, dict) and bool(PIPELINE_ONLY & set(data))


def cmd_sweep(args) -> int:
    pipeline = None
    if is_pipeline(args.config):  # trials over the pipeline's RL stage (--space fields of its rl section)
        given = load_tree(PipelineFile, args.config, args.set)
        pipeline = given.pipeline
        try:
            pipeline.check_rl_stage("a pipeline sweep varies")
        except ValueError as exc:
            raise SystemExit(f"invalid sweep: {exc}") from None
        config = RLHFConfig.of(merge(pipeline.rl, {"tracking.experiment": pipeline.tracking.experiment}), given.deploy)
    else:
        config = load_cli_config(args)
    sweep = load_sweep(args)
    try:
        check_sweep(config, sweep, pipeline=pipeline is not None)
    except SweepError as exc:
        raise SystemExit(f"invalid sweep: {exc}") from None
    env = project_env()
    if not PREFECT_API_URL.value():
        local = prefect_env(config.resolved_state_dir())  # the local stack's URL and credentials
        if not local:
            raise SystemExit("no Prefect server to run the trials on: start the local stack with `rlhf up` "
                             "(or set PREFECT_API_URL)")
        env.update(local)
    given = nested(parse_overrides(args.set)).get("deploy", {})  # what --set said of where the sweep and trials run
    if args.placement:
        given["placement"] = args.placement
    deploy = DeployConfig.model_validate(given).model_dump(mode="json", exclude_unset=True)
    command = [sys.executable, "-m", "flows.sweep", "--config", config.run.model_dump_json(),
               "--sweep", sweep.model_dump_json(), "--deploy", json.dumps(deploy)]
    if pipeline is not None:
        command += ["--pipeline", pipeline.model_dump_json()]
    return subprocess.run(command, env=env).returncode
