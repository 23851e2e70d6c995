"""The `rlhf models tiny`, `rlhf config` and `rlhf train` commands, and the config the CLI flags name."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from components.cli.options import parse_overrides
from components.launch.ranks import actor_ranks
from components.serving.rollout import attach, local_rollout_server
from models.config import load_config
from models.loop import read_data, train_in_process
from models.prepare import prepare_run
from models.tiny import build_tiny


def load_cli_config(args, overrides: dict | None = None):
    """The config of `--config`, `--preset` and `--set` (or already parsed `overrides`); exits naming a bad field."""
    try:
        return load_config(args.config, args.preset, overrides if overrides is not None else parse_overrides(args.set))
    except Exception as exc:  # pydantic ValidationError names the field
        raise SystemExit(f"invalid config: {exc}") from None


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

    evals = []

    def show_eval(i: int, m: dict) -> None:
        evals.append({"iteration": i, **m})
        print(f"[{cfg.algorithm}] eval at iteration {i}: " + "  ".join(f"{k.split('/', 1)[1]} {v:+.3f}" for k, v in m.items()),
              flush=True)

    log_dir = cfg.resolved_state_dir() / "logs" / "train"
    data = read_data(cfg)  # bad data fails here, before any model loads
    with (local_rollout_server(cfg, log_dir) as rollout_server, actor_ranks(cfg, log_dir) as actor,
          attach(rollout_server, actor, cfg)):
        try:
            history = train_in_process(actor.cfg, show, actor, show_eval, data)
        except Exception as exc:
            if rollout_server is not None and (death := rollout_server.death()):
                raise RuntimeError(death) from exc  # name the server that went away, not the broken connection
            raise
    if args.metrics_out:
        Path(args.metrics_out).write_text(json.dumps(history, indent=1))
    if args.eval_out:
        Path(args.eval_out).write_text(json.dumps(evals, indent=1))
    return 0
