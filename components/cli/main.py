"""The `rlhf` console script: every command and where it lives.

    rlhf models tiny | config | train          here
    rlhf serve critic|reward                    cli/serve.py (a server in the foreground)
    rlhf up | down | status | demo              launch/stack.py (the local Prefect + MLflow + deployments stack)
    rlhf compare                                tracking/compare.py (PPO vs RLOO from MLflow)
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import yaml

from components.environment import first_line, quiet

quiet()  # first: the model libraries imported below read these settings when they are imported

from components.cli.options import add_config_args, load_cli_config
from components.cli.serve import add_serve_parser
from components.launch import stack
from components.launch.ranks import actor_ranks
from components.tracking.compare import compare_runs, log_comparison
from components.tracking.run import default_tracking_uri
from models.config import RLHFConfig
from models.loop import train_in_process
from models.prepare import prepare_run
from models.tiny import build_tiny


def cmd_models_tiny(args) -> int:
    info = build_tiny(args.out, seed=args.seed)
    print(json.dumps(info, indent=2))
    return 0


def cmd_config(args) -> int:
    cfg = load_cli_config(args)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return 0


def cmd_train(args) -> int:
    """In-process training (no servers, no Prefect): the quickest way to see the algorithm learn."""
    cfg = prepare_run(load_cli_config(args))

    def show(i: int, m: dict) -> None:
        print(f"[{cfg.algorithm}] iteration {i + 1}/{cfg.iterations}  gold {m.get('objective/gold_reward', float('nan')):+.3f}"
              f"  score {m['objective/scores']:+.3f}  kl {m['objective/kl']:.3f}  step {m['time/step']:.2f}s", flush=True)

    with actor_ranks(cfg, cfg.resolved_state_dir() / "logs" / "train") as actor:
        history = train_in_process(actor.cfg, show, actor)
    if args.metrics_out:
        Path(args.metrics_out).write_text(json.dumps(history, indent=1))
    return 0


def cmd_compare(args) -> int:
    uri = args.tracking_uri or default_tracking_uri(RLHFConfig())
    png, md = compare_runs(uri, args.experiment, args.runs or None, Path(args.out))
    run_id = log_comparison(uri, args.experiment, png, md)
    print(Path(md).read_text())
    print(f"wrote {png} and {md}; logged to MLflow run {run_id} at {uri}")
    return 0


def add_stack_parsers(sub) -> None:
    p = sub.add_parser("up", help="start the local stack (Prefect, MLflow, deployments) on 127.0.0.1")
    p.add_argument("--prefect-port", type=int, default=stack.PREFECT_PORT)
    p.add_argument("--mlflow-port", type=int, default=stack.MLFLOW_PORT)
    p.add_argument("--no-profile", action="store_true", help="do not create/activate the rlhf-local Prefect profile")
    p.set_defaults(func=lambda a: bool(stack.up(prefect_port=a.prefect_port, mlflow_port=a.mlflow_port,
                                                set_profile=not a.no_profile)) and 0)
    sub.add_parser("down", help="stop what `rlhf up` started").set_defaults(func=lambda a: bool(stack.down()) and 0)
    sub.add_parser("status", help="show the local stack").set_defaults(func=lambda a: bool(stack.status()) and 0)
    sub.add_parser("demo", help="up + run ppo/default and reinforce/default + compare").set_defaults(
        func=lambda a: stack.demo())


def add_compare_parser(sub) -> None:
    """`rlhf compare [--experiment E] [--runs ID ...] [--out DIR]`."""
    p = sub.add_parser("compare", help="compare runs (default: latest PPO vs latest RLOO) as a PNG and a table")
    p.add_argument("--experiment", default="rlhf-flows")
    p.add_argument("--runs", nargs="*", help="MLflow run ids (default: latest finished run per algorithm)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: local stack, $MLFLOW_TRACKING_URI or sqlite)")
    p.add_argument("--out", default=".rlhf/compare", help="output directory")
    p.set_defaults(func=cmd_compare)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="RLHF (PPO, RLOO) as Prefect workflows.")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="model utilities").add_subparsers(dest="models_command", required=True)
    tiny = models.add_parser("tiny", help="build the tiny local policy / reward / critic (offline; the same seed gives the same data and models)")
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_models_tiny)

    config = sub.add_parser("config", help="print the resolved config")
    add_config_args(config)
    config.set_defaults(func=cmd_config)

    train = sub.add_parser("train", help="train in this process (no servers, no Prefect)")
    add_config_args(train)
    train.add_argument("--metrics-out", help="write the per-iteration metrics as JSON")
    train.set_defaults(func=cmd_train)

    add_serve_parser(sub)
    add_stack_parsers(sub)
    add_compare_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command; a failure prints its traceback, then one last line saying why (what a user reads first)."""
    quiet()
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"rlhf {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - reported, exit code 1
        traceback.print_exc()
        print(f"\nrlhf {args.command} failed: {first_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
