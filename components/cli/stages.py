"""`rlhf sft`, `rlhf reward-model`, `rlhf dpo`, `rlhf eval` and `rlhf pipeline`: a job other than an RL run, and the
whole pipeline, in this process, through the same job builder as their flows (components/runs.py,
components/pipeline/run.py)."""

from __future__ import annotations

from components.cli.files import load_tree, write_summary
from components.pipeline.config import PipelineFile
from components.pipeline.run import run_pipeline
from components.runs import train
from models.kinds import BY_JOB

# Where `rlhf pipeline`'s RL stage runs its critic and reward model unless the file names another placement: in this
# process, as `rlhf train` does (components/cli/main.py)
PIPELINE_PLACEMENT = "in_process"


def cmd_stage(args) -> int:
    """A stage run (sft, reward_model, dpo) or an eval in this process: checkpoints, resume by run_name, MLflow,
    held-out eval."""
    result = train(load_tree(BY_JOB[args.stage].run_class, args.config, args.set))
    write_summary(result, args.summary_out)
    return 0


def cmd_pipeline(args) -> int:
    """The pipeline in this process: stages reused where their keys match, --from rebuilds from a stage on."""
    given = load_tree(PipelineFile, args.config, args.set, defaults={"deploy": {"placement": PIPELINE_PLACEMENT}})
    result = run_pipeline(given.pipeline, given.deploy, rerun_from=args.from_stage)
    for stage, outcome in result["stages"].items():
        state = "given" if outcome.get("given") else "cached" if outcome["cached"] else "built"
        print(f"{stage:13s} {state:7s} {outcome['seconds']:7.1f}s  {outcome.get('model') or ''}")
    write_summary(result, args.summary_out)
    return 0
