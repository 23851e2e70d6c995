"""One racer of tests/components/pipeline/test_cache.py's race, in a process of its own (spawned: it imports only
the cache, not the models)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from components.pipeline.cache import Records, build_once


def racer(base_uri: str, endpoint: str | None, key: str, builds: str, log: str, result: str, env: dict,
          start) -> None:
    """One pipeline's view of one stage: reuse it, or build it (2 s, counted in `builds`) under its lock; it goes
    when every racer is ready (`start`, a barrier)."""
    os.environ.update(env)
    records = Records(base_uri, endpoint)

    def build() -> dict:
        with open(builds, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(2.0)
        return {"metrics": {"built_by": os.getpid()}}

    def note(message: str) -> None:
        with open(log, "a") as f:
            f.write(message + "\n")

    start.wait(timeout=120)
    outcome = build_once(records, "sft", key, build, f"racer-{os.getpid()}", note)
    Path(result).write_text(json.dumps({"reused": outcome.get("reused", False), "metrics": outcome["metrics"]}))
