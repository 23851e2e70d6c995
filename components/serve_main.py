"""`rlhf serve critic|reward`: run a critic or reward server in the foreground (what the launcher's child runs).

    rlhf serve critic --model PATH [--reward PATH] [--no-combine] --port 8400 --checkpoint-dir DIR [--lr ...]
    rlhf serve reward --model PATH | --function module:fn --tokenizer PATH --port 8500
    python -m components.serve_main critic ...      (the same, without the lead's CLI)

Settings come from, in increasing priority: the 'tiny' preset, --config YAML (an RLHFConfig file: model paths,
dtype, device and the critic section), --critic-config-json (a whole CriticConfig, used by the launcher), then flags.
The HTTP port is P, gRPC P+1, metrics P+2; the server binds 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from components.servers import CriticServer, RewardServer, ServeOptions, configure_logging

# flag -> dotted CriticConfig field
_CRITIC_FLAGS = {
    "lr": "optim.lr", "weight_decay": "optim.weight_decay", "warmup_steps": "optim.warmup_steps",
    "schedule": "optim.schedule", "total_steps": "optim.total_steps", "grad_clip": "optim.grad_clip",
    "loss_clip_val": "loss_clip_val", "train_batch_size": "train_batch_size", "epochs": "epochs",
    "max_queue_delay_us": "max_queue_delay_us",
}


def _common(parser: argparse.ArgumentParser, default_port_help: str) -> None:
    parser.add_argument("--config", help="RLHF config YAML supplying defaults (model paths, dtype, device, critic section).")
    parser.add_argument("--host", default=None, help="Interface to bind (default 127.0.0.1 or the config's host).")
    parser.add_argument("--port", type=int, default=None, help=f"HTTP port P; gRPC uses P+1, metrics P+2 ({default_port_help}).")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="Parameter dtype.")
    parser.add_argument("--device", default=None, help="'auto', 'cpu' or 'cuda[:N]'.")
    parser.add_argument("--max-batch-size", type=int, default=256, help="Largest batch Triton accepts and forms by dynamic batching.")
    parser.add_argument("--max-queue-delay-us", type=int, default=None, help="Dynamic-batching queue delay in microseconds.")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); 1 avoids oversubscription on small CPU hosts.")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add `serve critic` / `serve reward` to an argparse subparsers object; each sets `func(args) -> exit code`."""
    serve = subparsers.add_parser("serve", help="Run a critic or reward PyTriton server in the foreground.",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = serve.add_subparsers(dest="server", required=True)

    critic = kinds.add_parser("critic", help="critic_infer + critic_train + critic_save (values, value-model training).")
    critic.add_argument("--model", default=None, help="Critic checkpoint (token classification, 1 label); default: initialise from --reward.")
    critic.add_argument("--reward", default=None, help="Reward model: served in critic_infer (unless --no-combine) and the critic's initialisation.")
    critic.add_argument("--no-combine", action="store_true", help="Do not serve rewards from critic_infer (no reward model resident).")
    critic.add_argument("--checkpoint-dir", default=None, help="Where critic_save writes (atomically); an existing checkpoint there is resumed.")
    critic.add_argument("--checkpoint-uri", default=None, help="Also upload each save to this store (file:///dir or s3://bucket/prefix).")
    critic.add_argument("--checkpoint-key", default="critic-server", help="Key under --checkpoint-uri.")
    critic.add_argument("--s3-endpoint-url", default=None, help="Endpoint of an S3-compatible store for --checkpoint-uri.")
    critic.add_argument("--critic-config-json", default=None, help="A whole CriticConfig as JSON (flags below override it).")
    critic.add_argument("--lr", type=float, help="Peak learning rate.")
    critic.add_argument("--weight-decay", type=float, help="AdamW weight decay.")
    critic.add_argument("--warmup-steps", type=int, help="Linear warm-up steps.")
    critic.add_argument("--schedule", choices=["constant", "cosine", "linear"], help="LR schedule after warm-up.")
    critic.add_argument("--total-steps", type=int, help="Steps of the cosine/linear decay.")
    critic.add_argument("--grad-clip", type=float, help="Max global grad norm.")
    critic.add_argument("--loss-clip-val", type=float, help="Clip range of the value loss.")
    critic.add_argument("--train-batch-size", type=int, help="Sequences per critic optimizer step.")
    critic.add_argument("--epochs", type=int, help="Epochs per critic_train call.")
    _common(critic, "default: config critic.http_port, 8400")
    critic.set_defaults(func=run_critic_args)

    reward = kinds.add_parser("reward", help="reward_model: scores from a reward model or a Python function.")
    source = reward.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="Sequence-classification reward model (1 label).")
    source.add_argument("--function", default=None, help="'package.module:function(prompts, responses) -> list[float]'.")
    reward.add_argument("--tokenizer", default=None, help="Tokenizer to decode tokens for --function (default: the config's policy). "
                        "Clients that send no prompt_lengths (NeMo-Aligner's) get the whole sequence scored as the response.")
    _common(reward, "default: config reward.http_port, 8500")
    reward.set_defaults(func=run_reward_args)
    return serve


def _load_config(path: Optional[str]):
    from models.config import load_config

    return load_config(path)


def critic_config_from_args(args, base=None):
    """CriticConfig: base (config file) < --critic-config-json < flags."""
    from models.config import CriticConfig

    data = (base or CriticConfig()).model_dump()
    if args.critic_config_json:
        data.update(json.loads(args.critic_config_json))
    for flag, dotted in _CRITIC_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            target = data
            *parents, leaf = dotted.split(".")
            for part in parents:
                target = target[part]
            target[leaf] = value
    return CriticConfig.model_validate(data)


def serve_critic(cfg, model: Optional[str], reward: Optional[str], combine_reward: bool = True,
                 checkpoint_dir: Optional[str] = None, checkpoint_uri: Optional[str] = None,
                 checkpoint_key: str = "critic-server", s3_endpoint_url: Optional[str] = None, dtype: str = "float32",
                 device: str = "auto", host: str = "127.0.0.1", port: int = 8400, max_batch_size: int = 256,
                 torch_threads: Optional[int] = None) -> int:
    """Run the critic server until SIGTERM/SIGINT (blocking); `cfg` is a CriticConfig. Returns the exit code."""
    if not model and not reward:
        raise ValueError("critic server: give a critic checkpoint (--model) or a reward model to initialise it from (--reward)")
    if combine_reward and not reward:
        raise ValueError("critic server: combining rewards needs a reward model (--reward), or pass --no-combine")
    configure_logging()
    options = ServeOptions(host=host, port=port, max_batch_size=max_batch_size, max_queue_delay_us=cfg.max_queue_delay_us,
                           torch_threads=torch_threads)
    return CriticServer(cfg, model, reward, combine_reward, checkpoint_dir, checkpoint_uri, checkpoint_key,
                        s3_endpoint_url, dtype, device, options).run()


def serve_reward(model: Optional[str] = None, function: Optional[str] = None, tokenizer: Optional[str] = None,
                 dtype: str = "float32", device: str = "auto", host: str = "127.0.0.1", port: int = 8500,
                 max_batch_size: int = 256, max_queue_delay_us: int = 2000, torch_threads: Optional[int] = None) -> int:
    """Run the reward server until SIGTERM/SIGINT (blocking). Returns the exit code."""
    configure_logging()
    options = ServeOptions(host=host, port=port, max_batch_size=max_batch_size, max_queue_delay_us=max_queue_delay_us,
                           torch_threads=torch_threads)
    return RewardServer(model, function, tokenizer, dtype, device, options).run()


def run_critic_args(args) -> int:
    rl = _load_config(args.config)
    cfg = critic_config_from_args(args, rl.critic)
    model = args.model or (rl.resolve_model_path(rl.model.critic) if rl.model.critic else None)
    reward = args.reward or rl.resolve_model_path(rl.model.reward)
    return serve_critic(cfg, model, reward, combine_reward=not args.no_combine and cfg.combine_reward,
                        checkpoint_dir=args.checkpoint_dir, checkpoint_uri=args.checkpoint_uri,
                        checkpoint_key=args.checkpoint_key, s3_endpoint_url=args.s3_endpoint_url,
                        dtype=args.dtype or rl.model.dtype, device=args.device or rl.model.device,
                        host=args.host or rl.critic.host, port=args.port or rl.critic.http_port,
                        max_batch_size=args.max_batch_size, torch_threads=args.torch_threads)


def run_reward_args(args) -> int:
    rl = _load_config(args.config)
    model, function = args.model, args.function
    if model is None and function is None:  # fall back to the config's reward source
        if rl.reward.source == "function":
            function = rl.reward.function
        else:
            model = rl.resolve_model_path(rl.model.reward)
    tokenizer = args.tokenizer or (rl.resolve_model_path(rl.model.policy) if function else None)
    return serve_reward(model, function, tokenizer, dtype=args.dtype or rl.model.dtype,
                        device=args.device or rl.model.device, host=args.host or rl.reward.host,
                        port=args.port or rl.reward.http_port, max_batch_size=args.max_batch_size,
                        max_queue_delay_us=args.max_queue_delay_us if args.max_queue_delay_us is not None
                        else rl.critic.max_queue_delay_us, torch_threads=args.torch_threads)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m components.serve_main")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
