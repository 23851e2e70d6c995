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

import argparse

from components.cli.options import add_config_args, load_cli_config, parse_overrides
from components.serving.main import run
from components.serving.servers import ServerSpec


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add `serve critic` / `serve reward`; each sets `func(args) -> exit code`."""
    parser = subparsers.add_parser("serve", help="Run a critic or reward PyTriton server in the foreground.",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = parser.add_subparsers(dest="server", required=True)

    critic = kinds.add_parser("critic", help="critic_infer + critic_train + critic_save (values, value-model training).")
    critic.add_argument("--model", default=None, help="Critic checkpoint (model.critic); default: initialise from the reward model.")
    critic.add_argument("--reward", default=None, help="Reward model (model.reward): served in critic_infer unless --no-combine.")
    critic.add_argument("--no-combine", action="store_true", help="Do not serve rewards from critic_infer (critic.combine_reward=false).")
    critic.add_argument("--checkpoint-dir", default=None, help="Where critic_save writes (atomically); a save there is resumed.")
    critic.add_argument("--checkpoint-uri", default=None, help="The run's checkpoint store (file:///dir or s3://bucket/prefix): "
                        "saves are also uploaded there for the flow's checkpoint to adopt.")
    critic.add_argument("--restore-iteration", type=int, default=None, help="Start from iter_<N>/critic of --checkpoint-uri.")
    critic.add_argument("--nproc-per-node", type=int, default=None, help="Ranks of the server (critic.nproc_per_node): "
                        "rank 0 serves HTTP, every rank holds an FSDP2 shard of the critic.")

    reward = kinds.add_parser("reward", help="reward_model: scores from a reward model or a Python function.")
    source = reward.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="Sequence-classification reward model (model.reward, 1 label).")
    source.add_argument("--function", default=None, help="'package.module:function(prompts, responses) -> list[float]'.")
    reward.add_argument("--tokenizer", default=None, help="Tokenizer that decodes tokens for --function (model.policy). "
                        "Clients that send no prompt_lengths (NeMo-Aligner's) get the whole sequence scored as the response.")
    for sub, port in ((critic, "critic.http_port, 8400"), (reward, "reward.http_port, 8500")):
        add_config_args(sub)
        sub.add_argument("--host", default=None, help="Interface to bind (default: the config's host, 127.0.0.1).")
        sub.add_argument("--port", type=int, default=None, help=f"HTTP port P; gRPC P+1, metrics P+2 (default: {port}).")
        sub.add_argument("--max-batch-size", type=int, default=256, help="Largest batch Triton accepts and forms by dynamic batching.")
        sub.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's choice).")
        sub.set_defaults(func=run_args)
    return parser


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
