"""`rlhf serve critic|reward`: its flags and --set overrides -> one ServerSpec (its models pinned: models/resolve.py),
then the server in the foreground (the flags and their help: `SERVE_HELP` and `add_serve_parser` in
components/cli/main.py)."""

from __future__ import annotations

from components.cli.files import load_cli_config
from components.cli.options import parse_overrides
from components.serving.triton.contract import ServerSpec
from components.serving.triton.main import run
from models.resolve import pin


def spec_from_args(args) -> ServerSpec:
    """A ServerSpec from `rlhf serve` arguments: the config tree, then the flag shortcuts."""
    overrides = parse_overrides(args.set)
    if args.server == "critic":
        overrides.update({k: v for k, v in (("model.critic", args.model), ("model.reward", args.reward)) if v})
        if args.no_combine:
            overrides["critic.combine_reward"] = False
        if args.nproc_per_node:
            overrides["deploy.critic.nproc_per_node"] = args.nproc_per_node
    else:
        if args.model:
            overrides.update({"reward.source": "model", "model.reward": args.model})
        if args.function:
            overrides.update({"reward.source": "function", "reward.function": args.function})
        if args.tokenizer:
            overrides["model.policy"] = args.tokenizer
    cfg = load_cli_config(args, overrides)
    if args.server == "reward" and cfg.reward.source == "model" and not cfg.model.reward:
        raise SystemExit("rlhf serve reward: no reward model (model.reward): give --model PATH or --function "
                         "module:fn, or --preset tiny for the embedded tiny reward model")
    section = cfg.deploy.critic if args.server == "critic" else cfg.deploy.reward
    default_port = 8400 if args.server == "critic" else 8500
    extra = {}
    if args.server == "critic":
        extra = {"checkpoint_dir": args.checkpoint_dir, "checkpoint_uri": args.checkpoint_uri,
                 "restore_iteration": args.restore_iteration}
    spec = ServerSpec(kind=args.server, config=cfg, host=args.host or section.host, port=args.port or section.port
                      or default_port,
                      max_batch_size=args.max_batch_size, torch_threads=args.torch_threads, **extra)
    # a server started on its own is its own job: it pins the models it loads here (a run's servers get its pins)
    return spec.model_copy(update={"config": pin(cfg, spec.loaded_models)})


def run_args(args) -> int:
    return run(spec_from_args(args))
