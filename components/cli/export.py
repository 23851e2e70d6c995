"""`rlhf export RUN [--iteration N] --out DIR`: a run's model (its latest checkpoint, or iteration N; an RL run's
policy, a stage's model) as a Hugging Face model that plain transformers loads (components/export.py)."""

from __future__ import annotations

from components.cli.files import load_cli_config
from components.export import export_checkpoint, run_store


def cmd_export(args) -> int:
    cfg = load_cli_config(args)  # where the run's checkpoints are: deploy.checkpoint.uri, deploy.state_dir
    store = run_store(cfg, args.run_name)
    out, iteration = export_checkpoint(store, args.out, args.iteration, deploy=cfg.deploy)  # a LoRA base: found here
    print(f"exported iteration {iteration} of {store.uri} to {out}")
    return 0
