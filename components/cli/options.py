"""The config flags every `rlhf` command that takes a run's config shares (--config, --set, --preset, --placement);
light, so the parser loads no model code (components/cli/commands.py loads the config they name)."""

from __future__ import annotations

import argparse

import yaml


def parse_overrides(items: list[str]) -> dict:
    """`key.sub=value` pairs; values are parsed as YAML (numbers, booleans, lists)."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key] = yaml.safe_load(value)
    return out


PRESETS = ("none", "tiny")  # models/config.PRESETS (named here: the parser loads no model code)
PLACEMENTS = ("local", "in_process", "cluster")  # models/deploy.PLACEMENTS


def add_config_args(p: argparse.ArgumentParser, placement: str | None = None) -> None:
    """The config flags; `placement`: the command's own placement when neither they nor the file name one."""
    p.add_argument("--config", help="YAML file with any subset of the config tree")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override, e.g. --set ppo.optim.lr=1e-5 or --set deploy.actor.nproc_per_node=2 (repeatable)")
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="the values for what the file and --set leave unset (the config's `preset`): 'tiny' = the "
                        "embedded tiny models' (the demo), 'none' = the field defaults, for a real model (default: "
                        "the file's preset, else none)")
    p.add_argument("--placement", choices=PLACEMENTS, default=None,
                   help="where the run's parts run (deploy.placement): 'local' = servers as child processes, "
                        "'in_process' = the critic and reward model in the actor's process, 'cluster' = Kubernetes "
                        f"(default: the file's placement, else {placement or 'local'})")
    p.set_defaults(default_placement=placement)
