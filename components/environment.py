"""What every entry point of the project shares (`rlhf`, the deployment server, actor and server ranks): a quiet,
offline environment, and a failure said in one line."""

from __future__ import annotations

import os


def quiet(progress_bars: bool = False) -> None:
    """No telemetry (no internet here) and no noise from the model libraries. `progress_bars`: keep the Hugging
    Face libraries' bars (a model download into the cache, loading its weights): a terminal command a user watches
    (`rlhf train`, `rlhf export`); every other process (servers, ranks, the deployments' runs, whose output goes to
    log files) runs without them, and so do the children of a command (components/launch/processes.project_env)."""
    settings = [("DO_NOT_TRACK", "1"), ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
                ("MLFLOW_DISABLE_TELEMETRY", "true"), ("TRANSFORMERS_VERBOSITY", "error"),
                ("TOKENIZERS_PARALLELISM", "false"), ("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")]
    if not progress_bars:
        settings.append(("HF_HUB_DISABLE_PROGRESS_BARS", "1"))
    for key, value in settings:
        os.environ.setdefault(key, value)


def first_line(exc: BaseException) -> str:
    """'Type: first line of the message' of an exception: what a run list or a terminal has room for."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
