"""Shared fixtures: quiet, offline environment and the tiny models built once per test session."""

import os
import socket
from pathlib import Path

import pytest

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Tiny policy / reward / critic built offline by `models.tiny.build_tiny` (the code behind `rlhf models tiny`)."""
    from models.tiny import build_tiny

    cached = os.environ.get("RLHF_TEST_TINY_DIR")
    out = Path(cached) if cached else tmp_path_factory.mktemp("tiny")
    if not (out / "tiny.json").exists():
        build_tiny(out, seed=0, log=lambda *_: None)
    return {name: str(out / name) for name in ("policy", "reward", "critic", "reward-chars")}


def free_port_block(n: int = 3) -> int:
    """A base port p with p..p+n-1 free on 127.0.0.1 (never the defaults 5000 / 8000-8002)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535 or 4999 <= base <= 5001 or 7998 <= base <= 8003:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free block of ports")
