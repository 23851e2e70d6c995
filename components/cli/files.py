"""Config trees from files and flags, and summaries to files: what the commands share. Light (pydantic, yaml and the
config tree): the commands that only check a config load no model code with it."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from components.cli.options import parse_overrides
from models.config import load_config, nested
from models.sections import deep_merge


def load_tree(model_class, path: str | None, sets: list[str] | None, defaults: dict | None = None):
    """A config of `model_class` from `defaults` (a command's named placement), a YAML file (any subset) and --set
    overrides, over its field defaults; exits naming a bad field."""
    try:
        data = deep_merge({}, defaults or {})
        if path:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path} must hold a mapping, got {type(loaded).__name__}")
            data = deep_merge(data, loaded)
        return model_class.model_validate(deep_merge(data, nested(parse_overrides(sets))))
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError names the field; YAML and file errors too
        raise SystemExit(f"invalid config: {exc}") from None


def load_cli_config(args, overrides: dict | None = None):
    """The config of `--config`, `--set` (or already parsed `overrides`), `--preset` and `--placement`, over the
    command's own placement when nothing names one; exits naming a bad field."""
    try:
        return load_config(args.config, overrides if overrides is not None else parse_overrides(args.set),
                           args.preset, args.placement, args.default_placement)
    except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError names the field; YAML and file errors too
        raise SystemExit(f"invalid config: {exc}") from None


def write_summary(result: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=1, default=str))
