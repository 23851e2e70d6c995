"""The `rlhf` console script."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml


def quiet() -> None:
    """No telemetry (no internet here) and no download/progress noise from the model libraries."""
    for key, value in (("DO_NOT_TRACK", "1"), ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
                       ("MLFLOW_DISABLE_TELEMETRY", "true"), ("TRANSFORMERS_VERBOSITY", "error"),
                       ("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)


def parse_overrides(items: list[str]) -> dict:
    """`key.sub=value` pairs; values are parsed as YAML (numbers, booleans, lists)."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key] = yaml.safe_load(value)
    return out


def cmd_models_tiny(args) -> int:
    from models.tiny import build_tiny

    info = build_tiny(args.out, seed=args.seed)
    print(json.dumps(info, indent=2))
    return 0


def load_cli_config(args, overrides: dict | None = None):
    """The config of `--config`, `--preset` and `--set` (or already parsed `overrides`); exits naming a bad field."""
    from models.config import load_config

    try:
        return load_config(args.config, args.preset, overrides if overrides is not None else parse_overrides(args.set))
    except Exception as exc:  # pydantic ValidationError names the field
        raise SystemExit(f"invalid config: {exc}") from None


def cmd_config(args) -> int:
    cfg = load_cli_config(args)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return 0


def cmd_train(args) -> int:
    """In-process training (no servers, no Prefect): the quickest way to see the algorithm learn."""
    from models.loop import train_in_process

    cfg = load_cli_config(args)

    def show(i: int, m: dict) -> None:
        print(f"[{cfg.algorithm}] iteration {i + 1}/{cfg.iterations}  gold {m.get('objective/gold_reward', float('nan')):+.3f}"
              f"  score {m['objective/scores']:+.3f}  kl {m['objective/kl']:.3f}  step {m['time/step']:.2f}s", flush=True)

    from components.ranks import actor_ranks

    with actor_ranks(cfg, cfg.resolved_state_dir() / "logs" / "train") as actor:
        history = train_in_process(actor.cfg, show, actor)
    if args.metrics_out:
        Path(args.metrics_out).write_text(json.dumps(history, indent=1))
    return 0


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with any subset of the config tree")
    p.add_argument("--preset", default="tiny", help="named preset the file and --set apply on (default: tiny)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override, e.g. --set ppo.optim.lr=1e-5 or --set actor.nproc_per_node=2 (repeatable)")


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

    from components.compare import add_compare_parser
    from components.serve_main import add_serve_parser
    from components.stack import add_stack_parsers

    add_serve_parser(sub)
    add_stack_parsers(sub)
    add_compare_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command; a failure prints its traceback, then one last line saying why (what a user reads first)."""
    import traceback

    quiet()
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"rlhf {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - reported, exit code 1
        from components.tasks import first_line

        traceback.print_exc()
        print(f"\nrlhf {args.command} failed: {first_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
