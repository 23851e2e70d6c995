"""`rlhf experiment --config FILE`: check the experiment here (bad input is refused before any run starts), then run
the experiment flow (flows/experiment.py) in a child process of this shell, in the foreground; its runs are runs of
the training deployments on the Prefect server of the active profile, or of the local stack (`rlhf up`).
`rlhf experiment report NAME --out FILE`: the experiment's report rebuilt from MLflow as one self-contained HTML file
(and `--summary-out` its JSON)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL
from pydantic import ValidationError

from components.cli.options import parse_overrides
from components.cli.sweep import NumberLoader
from components.launch.processes import project_env
from components.launch.stack import prefect_env
from components.sweep.experiment import ExperimentConfig, check_experiment
from components.sweep.report import build, find_experiment
from components.sweep.space import SweepError
from components.tracking.run import default_tracking_uri
from models.config import RLHFConfig, nested
from models.deploy import DeployConfig
from models.sections import deep_merge


def load_experiment(path: str, overrides: list[str] | None) -> tuple[ExperimentConfig, dict]:
    """The experiment of FILE with --set over it (dotted keys of the file: seeds=5, base.iterations=4), and what
    --set said of where it runs (deploy.*); exits naming a bad field."""
    data = yaml.load(Path(path).read_text(), NumberLoader) if path else None
    if not isinstance(data, dict):
        raise SystemExit(f"invalid experiment: {path} must hold a mapping (name, base, arms, seeds, ...)")
    given = nested(parse_overrides(overrides))
    deploy = given.pop("deploy", {})
    try:
        experiment = ExperimentConfig.model_validate(deep_merge(data, given))
        deploy = DeployConfig.model_validate(deploy).model_dump(mode="json", exclude_unset=True)
    except ValidationError as exc:
        raise SystemExit("invalid experiment: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                                           for e in exc.errors())) from None
    return experiment, deploy


def cmd_experiment(args) -> int:
    if args.action == "report":
        return cmd_report(args)
    if not args.config:
        raise SystemExit("rlhf experiment needs --config FILE (name, base, arms, seeds, metrics, concurrency)")
    experiment, deploy = load_experiment(args.config, args.set)
    try:
        config = experiment.base_config(deploy)
        check_experiment(config, experiment)
    except (SweepError, ValidationError) as exc:
        raise SystemExit(f"invalid experiment: {exc}") from None
    env = project_env()
    if not PREFECT_API_URL.value():
        local = prefect_env(config.resolved_state_dir())  # the local stack's URL and credentials
        if not local:
            raise SystemExit("no Prefect server to run the experiment's runs on: start the local stack with `rlhf up` "
                             "(or set PREFECT_API_URL)")
        env.update(local)
    command = [sys.executable, "-m", "flows.experiment", "--experiment", experiment.model_dump_json(),
               "--deploy", json.dumps(deploy)]
    if args.summary_out:
        command += ["--summary-out", str(Path(args.summary_out).resolve())]
    return subprocess.run(command, env=env).returncode


def cmd_report(args) -> int:
    if not args.name:
        raise SystemExit("rlhf experiment report needs the experiment's NAME")
    uri = args.tracking_uri or default_tracking_uri(RLHFConfig())
    client = MlflowClient(uri)
    try:
        experiment_id, parent_run_id, experiment = find_experiment(client, args.experiment, args.name, uri)
    except LookupError as exc:
        raise SystemExit(str(exc)) from None
    result, md, page, _ = build(client, uri, experiment_id, parent_run_id, experiment, experiment.base_config())
    if not args.out and not args.summary_out:
        print(md)
    if args.out:
        Path(args.out).write_text(page)
        print(f"wrote {args.out} (experiment {args.name}: {len(result['arms'])} arms x {len(result['seeds'])} seeds)")
    if args.summary_out:
        Path(args.summary_out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.summary_out}")
    return 0
