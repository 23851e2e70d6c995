"""The config flags every `rlhf` command that takes a config shares (--config, --preset, --set); light, so the
parser loads no model code (components/cli/commands.py loads the config they name)."""

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


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with any subset of the config tree")
    p.add_argument("--preset", default="auto", choices=("auto", "tiny", "none"),
                   help="preset the file and --set apply on: 'tiny' (the embedded tiny models' settings), 'none' (the "
                        "field defaults, for a real model) or 'auto' (default: tiny when model.policy is the embedded "
                        "tiny policy, else none)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override, e.g. --set ppo.optim.lr=1e-5 or --set deploy.actor.nproc_per_node=2 (repeatable)")
