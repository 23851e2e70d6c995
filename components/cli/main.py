"""The `rlhf` console script: its parser, and where each command lives. A command's module is imported only when
it runs, so `rlhf up`, `status` and `--help` start without loading torch, Triton or MLflow.

    rlhf models tiny | config | train          components/cli/commands.py
    rlhf export                                 components/cli/export.py (a run's model as a Hugging Face directory)
    rlhf sft | reward-model | dpo | eval        components/cli/stages.py (the jobs other than RL)
    rlhf pipeline                               components/cli/stages.py (the whole pipeline)
    rlhf serve critic|reward                    components/cli/serve.py (a server in the foreground)
    rlhf up | down | status | demo              components/launch/stack.py (the local Prefect + MLflow +
                                                deployments stack)
    rlhf compare                                components/cli/compare.py (PPO vs RLOO from MLflow; a sweep's trials)
    rlhf sweep                                  components/cli/sweep.py (a sweep flow here, its trials on the
                                                deployments)
    rlhf experiment [report NAME]               components/cli/experiment.py (arms x paired seeds; its report)
    rlhf cluster manifests                      components/cli/cluster.py (every Kubernetes object a run would create)
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from components.environment import first_line, quiet
from components.cli.options import add_config_args
from components.launch import stack
from components.sweep.config import SweepConfig
from models.kinds import JOBS_BUT_RL, KINDS

PROGRESS_COMMANDS = ("train", "export")
# rlhf config --describe WHAT: a run's, a deployment's, a pipeline's, each other kind of job's (its command), a sweep's
DESCRIBED = ("run", "deploy", "pipeline", *(kind.command for kind in JOBS_BUT_RL), "sweep", "experiment")

SERVE_HELP = """    rlhf serve critic [--config YAML] [--set critic.optim.lr=1e-5 ...] [--model PATH] [--reward PATH]
                      [--no-combine] [--port 8400] [--checkpoint-dir DIR] [--checkpoint-uri s3://bucket/run]
                      [--restore-iteration N]
    rlhf serve reward [--config YAML] [--set ...] [--model PATH | --function module:fn [--tokenizer PATH]]
                      [--port 8500]
    python -m components.serving.triton.main --spec '<ServerSpec JSON>'   (what the launcher runs: one JSON doc)
    rlhf serve critic --nproc-per-node 2 ...                              (ranks 1..N-1 run `triton.main --follow`)

Settings: the config tree (--config YAML, then --set overrides, over the preset they name: --preset tiny for the
embedded tiny models' values) supplies the models, dtype, device and the critic/reward sections; the flags are
shortcuts for the model paths and the per-process settings. With --preset tiny and no model flags, the embedded tiny
models are served. HTTP on --port (Triton itself listens on a Unix socket behind it: no gRPC or metrics port).

Who may call: every request but liveness/readiness must be signed with the run's key (deploy.<kind>.auth=secret, the
default): give the server the secret in $RLHF_RUN_SECRET (or a file named by $RLHF_RUN_SECRET_FILE), never on the
command line, and its clients the same variable (CriticClient/RewardClient sign; the secret never crosses the wire);
a server without one does not start. A client that sends no credentials (NeMo-Aligner's) needs open mode:
--set deploy.critic.auth=none (inference, config and metadata answer anyone; the server says so when it starts).
"""


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add `serve critic` / `serve reward` (run by components/cli/serve.py)."""
    parser = subparsers.add_parser("serve", help="Run a critic or reward PyTriton server in the foreground.",
                                   description=SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = parser.add_subparsers(dest="server", required=True)

    critic = kinds.add_parser("critic",
                              help="critic_infer + critic_train + critic_save (values, value-model training).")
    critic.add_argument("--model", default=None,
                        help="Critic checkpoint (model.critic); default: initialise from the reward model.")
    critic.add_argument("--reward", default=None,
                        help="Reward model (model.reward): served in critic_infer unless --no-combine.")
    critic.add_argument("--no-combine", action="store_true",
                        help="Do not serve rewards from critic_infer (critic.combine_reward=false).")
    critic.add_argument("--checkpoint-dir", default=None,
                        help="Where critic_save writes (atomically); a save there is resumed.")
    critic.add_argument("--checkpoint-uri", default=None,
                        help="The run's checkpoint store (file:///dir or s3://bucket/prefix): "
                        "saves are also uploaded there for the flow's checkpoint to adopt.")
    critic.add_argument("--restore-iteration", type=int, default=None,
                        help="Start from iter_<N>/critic of --checkpoint-uri.")
    critic.add_argument("--nproc-per-node", type=int, default=None, help="Ranks of the server (critic.nproc_per_node): "
                        "rank 0 serves HTTP, every rank holds an FSDP2 shard of the critic.")

    reward = kinds.add_parser("reward", help="reward_model: scores from a reward model or a Python function.")
    source = reward.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="Sequence-classification reward model (model.reward, 1 label).")
    source.add_argument("--function", default=None,
                        help="'package.module:function(prompts, responses) -> list[float]'.")
    reward.add_argument("--tokenizer", default=None,
                        help="Tokenizer that decodes tokens for --function (model.policy). "
                        "Clients that send no prompt_lengths (NeMo-Aligner's) get the whole sequence scored as the "
                        "response.")
    for sub, port in ((critic, "8400"), (reward, "8500")):
        add_config_args(sub)
        sub.add_argument("--host", default=None, help="Interface to bind (default: the config's host, 127.0.0.1).")
        sub.add_argument("--port", type=int, default=None, help=f"HTTP port (default: {port}).")
        sub.add_argument("--max-batch-size", type=int, default=256,
                         help="Largest batch Triton accepts and forms by dynamic batching.")
        sub.add_argument("--torch-threads", type=int, default=None,
                         help="torch intra-op threads (default: torch's choice).")
        sub.set_defaults(run="components.cli.serve:run_args")
    return parser


def add_stack_parsers(sub) -> None:
    p = sub.add_parser("up", help="start the local stack (Prefect, MLflow, deployments) on 127.0.0.1")
    p.add_argument("--prefect-port", type=int, default=stack.PREFECT_PORT)
    p.add_argument("--mlflow-port", type=int, default=stack.MLFLOW_PORT)
    p.add_argument("--no-profile", action="store_true", help="do not create/activate the rlhf-local Prefect profile")
    p.set_defaults(run=lambda a: bool(stack.up(prefect_port=a.prefect_port, mlflow_port=a.mlflow_port,
                                               set_profile=not a.no_profile)) and 0)
    sub.add_parser("down", help="stop what `rlhf up` started").set_defaults(run=lambda a: bool(stack.down()) and 0)
    sub.add_parser("status", help="show the local stack").set_defaults(run=lambda a: bool(stack.status()) and 0)
    sub.add_parser("demo", help="up + run ppo/default and reinforce/default + compare").set_defaults(
        run=lambda a: stack.demo())


def add_compare_parser(sub) -> None:
    """`rlhf compare [--experiment E] [--runs ID ...] [--out DIR]`."""
    p = sub.add_parser("compare", help="compare runs (default: latest PPO vs latest RLOO) as a PNG and a table")
    p.add_argument("--experiment", default="rlhf-flows")
    p.add_argument("--runs", nargs="*", help="MLflow run ids (default: latest finished run per algorithm)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: local stack, $MLFLOW_TRACKING_URI or sqlite)")
    p.add_argument("--out", default=".rlhf/compare", help="output directory")
    p.add_argument("--sweep", metavar="NAME", help="every trial of the sweep NAME instead (logged on its parent run)")
    p.set_defaults(run="components.cli.compare:cmd_compare")


SWEEP_HELP = """Run a hyperparameter sweep (an Optuna study) as a Prefect flow in this shell; its trials are runs of the
algorithm's deployment (ppo/default or reinforce/default) on the local stack that `rlhf up` started.

    rlhf sweep --preset tiny --set algorithm=rloo --set eval.prompts=builtin:sentiment --set eval.every=4 \\
        --name lr-kl --space 'reinforce.optim.lr=[1e-6, 1e-3]' --space 'kl.beta=[0.01, 0.1]' --concurrency 2
    rlhf sweep --config run.yaml --sweep sweep.yaml --pruner median

The base config: --config YAML, then --set, over the preset they name (as `rlhf train`; --preset tiny: the embedded
tiny models). The sweep section: --sweep YAML (any of its fields), then the flags below. Bad input is refused before
any trial starts, naming the field."""


def add_sweep_parser(sub) -> None:
    """`rlhf sweep`: the config flags of `rlhf train`, and the sweep section from a YAML file and/or flags (one per
    field of components/sweep/config.py)."""
    p = sub.add_parser("sweep",
                       help="run a hyperparameter sweep (Optuna); its trials run on the local stack's deployments",
                       description=SWEEP_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--sweep", metavar="YAML", help="the sweep section as a YAML file (the flags below override it)")
    p.add_argument("--space", action="append", metavar="FIELD=VALUES",
                   help="a dotted config field and its values as YAML: a list ('kl.beta=[0.01, 0.1]') or a range "
                        "('reinforce.optim.lr={low: 1e-5, high: 1e-3, log: true}'); repeatable")
    for name, field in SweepConfig.model_fields.items():
        if name != "space":
            default = "" if field.is_required() else f" (default: {field.default})"
            p.add_argument(f"--{name.replace('_', '-')}", dest=f"sweep_{name}", metavar=name.upper(),
                           help=f"{field.description}{default}")
    p.set_defaults(run="components.cli.sweep:cmd_sweep")


EXPERIMENT_HELP = """Run an experiment (arms x paired seeds, compared with rliable's interval estimates) as a Prefect
flow in this shell; each arm x seed is a run of its algorithm's deployment on the local stack that `rlhf up` started.

    rlhf experiment --config examples/experiment.yaml [--set seeds=5] [--summary-out summary.json]
    rlhf experiment report NAME --out report.html [--summary-out summary.json]

The file names `name`, `base` (a partial run config), `arms` (arm -> a partial config over base), `seeds` (a count or
a list, the same for every arm), `metrics`, `concurrency` (components/sweep/experiment.py documents every field).
Rerunning a name resumes it: a finished arm x seed is never run again. Bad input is refused before any run starts."""


def add_experiment_parser(sub) -> None:
    """`rlhf experiment --config FILE` and `rlhf experiment report NAME --out FILE`."""
    p = sub.add_parser("experiment", help="arms x paired seeds with interval estimates (rliable) and a report",
                       description=EXPERIMENT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", nargs="?", choices=("report",), help="report: rebuild the report of experiment NAME")
    p.add_argument("name", nargs="?", metavar="NAME", help="the experiment (with report)")
    p.add_argument("--config", metavar="FILE", help="the experiment as YAML")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field of the file (seeds=5, "
                   "base.iterations=4) or where it runs (deploy.tracking.uri=...); repeatable")
    p.add_argument("--summary-out", metavar="FILE", help="write the experiment's summary (runs, statistics) as JSON")
    p.add_argument("--out", metavar="FILE", help="report: the self-contained HTML report")
    p.add_argument("--experiment", default="rlhf-flows", help="report: the MLflow experiment holding it")
    p.add_argument("--tracking-uri", default=None, help="report: the MLflow server (default: the local stack's)")
    p.set_defaults(run="components.cli.experiment:cmd_experiment")


PIPELINE_HELP = """Run the whole pipeline in this process: sft -> reward_model -> rl -> eval, each stage reused when
nothing it was made from changed (its config, its data, its upstream models, the code).

    rlhf pipeline --config examples/pipeline.yaml --summary-out summary.json
    rlhf pipeline --config examples/pipeline.yaml --set rl.reinforce.optim.lr=1e-4     (reuses sft and reward_model)
    rlhf pipeline --config examples/pipeline.yaml --from reward_model                  (rebuilds it, rl and eval)

The file holds the pipeline's sections (name, base_model, sft, reward_model, rl, eval, tracking, checkpoint) and
optionally `deploy` (where its ranks and servers run: the in_process placement unless it names another, so the RL
stage's critic and reward model run in this process). The same flow is the pipeline/default deployment."""


def add_stage_parsers(sub) -> None:
    """`rlhf <command>` of every kind of job but RL's (models/kinds.py: sft, reward-model, dpo, eval;
    components/cli/stages.py) and `rlhf pipeline`."""
    for name, stage, text in ((kind.command, kind.job, kind.summary) for kind in JOBS_BUT_RL):
        p = sub.add_parser(name, help=f"{text}, in this process (checkpoints, resume by run_name, MLflow)")
        p.add_argument("--config",
                       help=f"YAML file with any subset of the run's tree (model, {stage}, seed, tracking, checkpoint, "
                            "deploy)")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help=f"override, e.g. --set {stage}.optim.lr=1e-4 (repeatable)")
        p.add_argument("--summary-out", help="write the run's summary as JSON (its model, metrics, evals)")
        p.set_defaults(run="components.cli.stages:cmd_stage", stage=stage)
    p = sub.add_parser("pipeline", help="sft -> reward model -> RL -> eval, each stage cached by what it was made from",
                       description=PIPELINE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file with any subset of the pipeline's tree (default: the embedded default)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override, e.g. --set rl.iterations=20 (repeatable)")
    p.add_argument("--from", dest="from_stage", choices=tuple(kind.job for kind in KINDS),
                   help="build this stage and every one after it again, even where a record matches")
    p.add_argument("--summary-out", help="write the summary as JSON: {stages: {stage: {cached, model, metrics}}}")
    p.set_defaults(run="components.cli.stages:cmd_pipeline")


def add_cluster_parser(sub) -> None:
    """`rlhf cluster manifests [--config FILE] [--set ...] [--placement cluster] --out DIR`."""
    cluster = sub.add_parser("cluster", help="the Kubernetes side of a run").add_subparsers(dest="cluster_command",
                                                                                            required=True)
    p = cluster.add_parser("manifests", help="write every Kubernetes object a run of this config would create (its "
                                             "JobSet, its servers' LeaderWorkerSets and Secrets with placeholder "
                                             "values, its NetworkPolicies) as YAML, for review or kubectl apply "
                                             "--dry-run=server")
    add_config_args(p, placement="cluster")
    p.add_argument("--out", required=True, help="output directory (one YAML file per object)")
    p.set_defaults(run="components.cli.cluster:cmd_manifests")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="RLHF (PPO, RLOO) as Prefect workflows.")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="model utilities").add_subparsers(dest="models_command", required=True)
    tiny = models.add_parser("tiny",
                             help="build the tiny local policy / reward / critic (offline; the same seed gives the "
                                  "same data and models)")
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run="components.cli.commands:cmd_models_tiny")

    config = sub.add_parser("config",
                            help="print the resolved config (or, with --describe, every field and what it means)")
    add_config_args(config)
    config.add_argument("--describe", nargs="?", const="run", metavar="WHAT", choices=DESCRIBED,
                        help="print every field of a config tree with its type, default and description instead: "
                             f"{', '.join(DESCRIBED)} (default: run, what `rlhf train` takes, its deploy section "
                             "included; the fields sections mark advanced only with --all)")
    config.add_argument("--all", action="store_true", help="with --describe: the advanced fields too (request limits, "
                        "threads and cores, timeouts, ports)")
    config.set_defaults(run="components.cli.commands:cmd_config")

    train = sub.add_parser("train", help="a training run in this process (checkpoints, resume by run_name, MLflow, "
                                         "eval; no Prefect); with no config at all, the tiny preset's demo")
    # its critic and reward model in this process unless another placement is named: no servers to start, the quickest
    # way to see a run learn (a vLLM rollout server, for rollout.engine=vllm, is still a local child)
    add_config_args(train, placement="in_process")
    train.add_argument("--metrics-out", help="write the per-iteration metrics as JSON")
    train.add_argument("--eval-out", help="write the held-out evals (eval.*) as JSON: [{iteration, metrics...}]")
    train.add_argument("--summary-out",
                       help="write the run's summary as JSON (run name, MLflow run, checkpoint, metrics)")
    train.set_defaults(run="components.cli.commands:cmd_train")

    export = sub.add_parser("export", help="a run's trained policy (its latest checkpoint, or --iteration N) as a "
                                           "Hugging Face model directory (LoRA merged, tokenizer and chat template)")
    export.add_argument("run_name", metavar="RUN", help="a run name (its checkpoints in deploy.checkpoint.uri, else "
                        "<state_dir>/checkpoints), or a run's checkpoint store: file:///..., s3://bucket/prefix/run, a "
                        "directory")
    export.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: the latest)")
    export.add_argument("--out", required=True, help="output directory (new or empty)")
    add_config_args(export)
    export.set_defaults(run="components.cli.export:cmd_export")

    add_stage_parsers(sub)
    add_serve_parser(sub)
    add_stack_parsers(sub)
    add_compare_parser(sub)
    add_sweep_parser(sub)
    add_experiment_parser(sub)
    add_cluster_parser(sub)
    return parser


def command(args):
    """The function that runs a parsed command: 'module:function' names are imported now, when the command runs."""
    if isinstance(args.run, str):
        module, name = args.run.split(":")
        return getattr(importlib.import_module(module), name)
    return args.run


def main(argv: list[str] | None = None) -> int:
    """Run a command; a failure prints its traceback, then one last line saying why (what a user reads first)."""
    args = build_parser().parse_args(argv)  # the parser loads no model library
    quiet(progress_bars=args.command in PROGRESS_COMMANDS)  # before the model libraries read these settings
    try:
        return int(command(args)(args) or 0)
    except KeyboardInterrupt:
        print(f"rlhf {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - reported, exit code 1
        traceback.print_exc()
        print(f"\nrlhf {args.command} failed: {first_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
