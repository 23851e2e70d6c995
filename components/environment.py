"""What every entry point of the project shares (`rlhf`, the deployment server, actor and server ranks): a quiet,
offline environment, and a failure said in one line."""

from __future__ import annotations

import os


def quiet() -> None:
    """No telemetry (no internet here) and no download/progress noise from the model libraries."""
    for key, value in (("DO_NOT_TRACK", "1"), ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
                       ("MLFLOW_DISABLE_TELEMETRY", "true"), ("TRANSFORMERS_VERBOSITY", "error"),
                       ("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                       ("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")):
        os.environ.setdefault(key, value)


def first_line(exc: BaseException) -> str:
    """'Type: first line of the message' of an exception: what a run list or a terminal has room for."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
