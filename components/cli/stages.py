"""`rlhf sft`, `rlhf reward-model` and `rlhf pipeline`: the stages before RL and the whole pipeline in this process,
through the same run builders as their flows (components/stages.py, components/pipeline/run.py)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from components.cli.options import parse_overrides
from components.pipeline.config import PipelineFile
from components.pipeline.run import run_pipeline
from components.stages import train_stage
from models.config import deep_merge, merge
from models.stages.config import STAGE_RUNS

# Where `rlhf pipeline`'s RL stage runs its critic and reward model unless the file says otherwise: in this process,
# as `rlhf train` does (components/cli/commands.TRAIN_DEPLOY)
PIPELINE_DEPLOY = {"critic": {"launch": "in_process"}, "reward": {"launch": "in_process"}, "rollout": {"launch": "local"}}


def load_tree(model_class, path: str | None, sets: list[str] | None, defaults: dict | None = None):
    """A config of `model_class` from its defaults, `defaults`, a YAML file (any subset) and --set overrides; exits
    naming a bad field."""
    try:
        data = deep_merge({}, defaults or {})
        if path:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path} must hold a mapping, got {type(loaded).__name__}")
            data = deep_merge(data, loaded)
        return merge(model_class.model_validate(data), parse_overrides(sets))
    except SystemExit:
        raise
    except Exception as exc:  # pydantic's ValidationError names the field
        raise SystemExit(f"invalid config: {exc}") from None


def write_summary(result: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=1, default=str))


def cmd_stage(args) -> int:
    """A stage run (sft or reward_model) in this process: checkpoints, resume by run_name, MLflow, held-out eval."""
    cfg = load_tree(STAGE_RUNS[args.stage], args.config, args.set)
    result = train_stage(cfg)
    write_summary({k: v for k, v in result.items() if k != "history"} | {"history": result["history"]}, args.summary_out)
    return 0


def cmd_pipeline(args) -> int:
    """The pipeline in this process: stages reused where their keys match, --from rebuilds from a stage on."""
    given = load_tree(PipelineFile, args.config, args.set, defaults={"deploy": PIPELINE_DEPLOY})
    result = run_pipeline(given.pipeline, given.deploy, rerun_from=args.from_stage)
    for stage, outcome in result["stages"].items():
        state = "given" if outcome.get("given") else "cached" if outcome["cached"] else "built"
        print(f"{stage:13s} {state:7s} {outcome['seconds']:7.1f}s  {outcome.get('model') or ''}")
    write_summary(result, args.summary_out)
    return 0
