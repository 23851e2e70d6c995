"""`rlhf serve critic|reward`: run a critic or reward server in the foreground (flags and --set -> one ServerSpec).

    rlhf serve critic [--config YAML] [--set critic.optim.lr=1e-5 ...] [--model PATH] [--reward PATH] [--no-combine]
                      [--port 8400] [--checkpoint-dir DIR] [--checkpoint-uri s3://bucket/run] [--restore-iteration N]
    rlhf serve reward [--config YAML] [--set ...] [--model PATH | --function module:fn [--tokenizer PATH]] [--port 8500]
    python -m components.serving.main --spec '<ServerSpec JSON>'   (what the launcher runs: one JSON document)
    rlhf serve critic --nproc-per-node 2 ...                       (ranks 1..N-1 run `serving.main --follow`)

Settings: the config tree (the 'tiny' preset, then --config YAML, then --set overrides) supplies the models, dtype,
device and the critic/reward sections; the flags are shortcuts for the model paths and the per-process settings.
Without a model the embedded default is served (built on first use). HTTP port P, gRPC P+1, metrics P+2.
"""

from __future__ import annotations

from components.cli.commands import load_cli_config
from components.cli.options import parse_overrides
from components.serving.main import run
from components.serving.servers import ServerSpec


def spec_from_args(args) -> ServerSpec:
    """A ServerSpec from `rlhf serve` arguments: the config tree, then the flag shortcuts."""
    overrides = parse_overrides(args.set)
    if args.server == "critic":
        overrides.update({k: v for k, v in (("model.critic", args.model), ("model.reward", args.reward)) if v})
        if args.no_combine:
            overrides["critic.combine_reward"] = False
        if args.nproc_per_node:
            overrides["critic.nproc_per_node"] = args.nproc_per_node
    else:
        if args.model:
            overrides.update({"reward.source": "model", "model.reward": args.model})
        if args.function:
            overrides.update({"reward.source": "function", "reward.function": args.function})
        if args.tokenizer:
            overrides["model.policy"] = args.tokenizer
    cfg = load_cli_config(args, overrides)
    section = cfg.critic if args.server == "critic" else cfg.reward
    extra = {}
    if args.server == "critic":
        extra = {"checkpoint_dir": args.checkpoint_dir, "checkpoint_uri": args.checkpoint_uri,
                 "restore_iteration": args.restore_iteration}
    return ServerSpec(kind=args.server, config=cfg, host=args.host or section.host, port=args.port or section.http_port,
                      max_batch_size=args.max_batch_size, torch_threads=args.torch_threads, **extra)


def run_args(args) -> int:
    return run(spec_from_args(args))
