"""The embedded default as files: the tiny policy, reward model, critic, reward-chars and the chat model ship with
the package (models/assets/tiny/<name>, ~3.5 MB in all), so every machine runs the same model whatever CPU kernels it
has.

`rlhf models tiny --out DIR` (models/tiny.py) is the script that made them; what it trains depends on the CPU's
kernels (AVX2 vs AVX-512 give other weights), which is why the result is shipped instead of rebuilt on each machine.
`MANIFEST.json` records how they were built and the sha256 of every file, and of every tensor as it loads; a test
checks them (tests/models/test_tiny.py). Light: no torch import (the CLI resolves model paths with it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

TINY_PREFIX = "tiny"  # model paths "tiny/<name>" name the embedded default
EMBEDDED_DIR = Path(__file__).parent / "assets" / "tiny"
TEMPLATES_DIR = Path(__file__).parent / "assets" / "templates"  # chat templates the embedded models carry
MANIFEST = EMBEDDED_DIR / "MANIFEST.json"
NAMES = ("policy", "reward", "critic", "reward-chars", "chat")


def is_embedded(value: str | None) -> bool:
    """Whether a model field names the embedded default ('tiny/<name>')."""
    return bool(value) and value.startswith(f"{TINY_PREFIX}/")


def is_tiny_policy(value: str) -> bool:
    """Whether a model.policy value is the embedded tiny policy ('tiny/policy', or its shipped directory)."""
    if value == f"{TINY_PREFIX}/policy":
        return True
    try:
        return Path(value).expanduser().resolve() == (EMBEDDED_DIR / "policy").resolve()
    except (OSError, ValueError):
        return False


def embedded_model_path(value: str) -> Path:
    """The shipped directory of 'tiny/<name>'; an unknown name is refused, naming the known ones."""
    name = value.split("/", 1)[1]
    if name not in NAMES:
        raise FileNotFoundError(f"'{value}' is not an embedded model; the embedded default is "
                                f"{', '.join(f'{TINY_PREFIX}/{n}' for n in NAMES)}")
    return EMBEDDED_DIR / name


def manifest_digest(files: dict[str, str]) -> str:
    """One sha256 for a directory from its `file_digests`: over every file's relative path and sha256, in path order."""
    return hashlib.sha256("".join(f"{name}\0{digest}\n" for name, digest in sorted(files.items())).encode()).hexdigest()


def manifest() -> dict:
    return json.loads(MANIFEST.read_text())
