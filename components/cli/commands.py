"""The `rlhf models tiny`, `rlhf config` and `rlhf train` commands, and the config the CLI flags name."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from components.cli.options import parse_overrides
from components.launch.ranks import actor_ranks
from components.serving.services import RunPlace, rollout_server, run_services
from models.config import load_config, merge
from models.loop import Hooks, read_data, run_loop
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
    """In-process training (critic and reward in this process, no Prefect, no checkpoints; the vLLM rollout server
    when rollout.engine=vllm): the quickest way to see the algorithm learn. The same services and loop as a flow."""
    cfg = prepare_run(merge(load_cli_config(args), {"critic.launch": "in_process", "reward.launch": "in_process",
                                                    "rollout.vllm.launch": "local"}))
    prompts, evals = read_data(cfg)  # bad data fails here, before any model loads
    history, evaluations = [], []

    def show(i: int, m: dict, samples: list) -> None:
        history.append(m)
        stale = f"  staleness {m['rollout/staleness_max']:g}" if "rollout/staleness_max" in m else ""
        print(f"[{cfg.algorithm}] iteration {i}/{cfg.iterations}  gold {m.get('objective/gold_reward', float('nan')):+.3f}"
              f"  score {m['objective/scores']:+.3f}  kl {m['objective/kl']:.3f}  step {m['time/step']:.2f}s{stale}",
              flush=True)

    def show_eval(i: int, m: dict, rows: list) -> None:
        evaluations.append({"iteration": i, **m})
        print(f"[{cfg.algorithm}] eval at iteration {i}: " + "  ".join(f"{k.split('/', 1)[1]} {v:+.3f}" for k, v in m.items()),
              flush=True)

    log_dir = cfg.resolved_state_dir() / "logs" / "train"
    place = RunPlace(cfg.run_name or f"train-{cfg.algorithm}", log_dir)
    with rollout_server(cfg, place) as rollout, actor_ranks(cfg, log_dir) as actor, \
            run_services(cfg, place, actor, rollout=rollout) as services:
        run_loop(cfg, actor, prompts, evals, Hooks.direct(services.critic, services.reward, services.guard,
                                                          log=show, logged_eval=show_eval))
    if args.metrics_out:
        Path(args.metrics_out).write_text(json.dumps(history, indent=1))
    if args.eval_out:
        Path(args.eval_out).write_text(json.dumps(evaluations, indent=1))
    return 0
