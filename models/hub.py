"""Where a model field's value is on this machine: the one resolver every load goes through (policy, reward model,
critic, tokenizer; `rlhf train`, the flows and every server process).

A value is the embedded default `tiny/<name>` (shipped with the package), a local directory written by
`save_pretrained`, or a Hugging Face hub id `org/name` (at `model.revision`). A hub id resolves to its snapshot in the
Hugging Face cache (HF_HUB_CACHE, in the hub's own layout: models--org--name/snapshots/<commit>/, refs/<branch>) with
no network access, as transformers itself loads a cached id offline. An id that is not cached is downloaded into the
cache (with the hub's progress bars) where the hub is reachable; with HF_HUB_OFFLINE=1 (`rlhf up`, the tests, an
air-gapped cluster) it fails naming the field, the id and the command that fetches it. So every process of a run
loads the same files from a local directory, and each process resolves on its own machine (a cluster pod resolves in
its own cache).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from models.tiny_files import embedded_model_path, is_embedded

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # 'org/name' (or a legacy 'name')
# what a download fetches: weights as safetensors, configs, tokenizer files, chat templates (no remote code)
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def looks_like_hub_id(value: str) -> bool:
    """Whether a value that is not a local directory may name a hub repository (not a path: no leading '.', '/'
    or '~', at most one '/')."""
    return bool(HUB_ID.match(value)) and not value.endswith((".json", ".safetensors"))


def offline() -> bool:
    """Whether the hub is out of reach by configuration (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    return any(os.environ.get(key, "").strip().lower() in ("1", "true", "yes", "on")
               for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def cache_dir() -> str:
    """The Hugging Face hub cache as this process sees it now (HF_HUB_CACHE, else HF_HOME/hub, else the default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants  # light; read at call time so a changed environment counts

    return constants.HF_HUB_CACHE


def fetch_command(repo_id: str, revision: str | None = None, client: str = "hf") -> str:
    """The command that puts `repo_id` into the cache where the hub is reachable (`client`: 'hf', or the older
    'huggingface-cli')."""
    return f"{client} download {repo_id}" + (f" --revision {revision}" if revision else "")


def resolve_model(value: str, field: str = "model", revision: str | None = None) -> str:
    """The local directory of a model field's value (see the module docstring); raises FileNotFoundError naming
    `field` when there is none."""
    if is_embedded(value):
        return str(embedded_model_path(value))
    path = Path(value).expanduser()
    if path.is_dir():
        return str(path)
    if not looks_like_hub_id(value):
        raise FileNotFoundError(
            f"{field}: model path '{value}' does not exist (expected a directory saved with save_pretrained, a hub id "
            f"'org/name' in the Hugging Face cache, or tiny/<name>, the embedded default)")
    from huggingface_hub import snapshot_download  # only a hub id needs it (~0.3 s)
    from huggingface_hub.errors import LocalEntryNotFoundError  # as above

    cache = cache_dir()
    try:
        return snapshot_download(value, revision=revision, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    at = f" at revision '{revision}'" if revision else ""
    if offline():
        raise FileNotFoundError(
            f"{field}: '{value}'{at} is neither a local directory nor in the Hugging Face cache ({cache}), and the hub "
            f"is not reachable from here (HF_HUB_OFFLINE=1). Fetch it where the hub is reachable, into the cache this "
            f"machine reads (HF_HUB_CACHE): `{fetch_command(value, revision)}` (older clients: "
            f"`{fetch_command(value, revision, 'huggingface-cli')}`); or point {field} at a local directory")
    try:  # reachable: fetch it into the cache once (the hub's progress bars show), then every process finds it there
        return snapshot_download(value, revision=revision, cache_dir=cache, allow_patterns=MODEL_FILES)
    except Exception as exc:  # noqa: BLE001 - unknown repo, gated, no network: all end here, naming the field
        raise FileNotFoundError(
            f"{field}: '{value}'{at} is neither a local directory nor in the Hugging Face cache ({cache}), and "
            f"downloading it failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); fetch it "
            f"with `{fetch_command(value, revision)}`") from exc
