"""Shared fixtures: quiet, offline environment and the tiny models built once per test session."""

import json
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
def tiny_dir() -> Path:
    """The embedded default as shipped with the package (models/assets/tiny: tiny policy, reward, critic,
    reward-chars), the same files on every machine."""
    from models.tiny_files import EMBEDDED_DIR

    return EMBEDDED_DIR


@pytest.fixture(scope="session")
def tiny_models(tiny_dir) -> dict[str, str]:
    """Paths of the tiny policy / reward / critic."""
    return {name: str(tiny_dir / name) for name in ("policy", "reward", "critic")}


@pytest.fixture(scope="session")
def tiny_reward_chars(tiny_dir) -> str:
    """Path of tiny/reward-chars (a reward model with a character tokenizer of its own)."""
    return str(tiny_dir / "reward-chars")


def pytest_collection_modifyitems(items):
    """Modules marked slow first (they start whole stacks and run for minutes), so that under pytest-xdist's
    `--dist loadfile` the longest module starts at once and the short ones fill the other worker around it. The
    order inside a module is kept."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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


def assert_learned_with_eval(metrics_path: Path, evals_path: Path) -> list[dict]:
    """What an `rlhf train --metrics-out M --eval-out E` run of 12 iterations with eval.every=6 on the shipped task
    must show: the held-out eval at 0, 6 and 12 over the 40 test prompts, rising by >= 0.2, and the training gold
    reward rising by the margin of tests/models/test_steps.py (>= 0.3). Returns the per-iteration metrics."""
    evals = json.loads(evals_path.read_text())
    assert [e["iteration"] for e in evals] == [0, 6, 12] and {e["eval/samples"] for e in evals} == {40.0}
    assert evals[-1]["eval/gold_reward"] - evals[0]["eval/gold_reward"] >= 0.2, evals
    history = json.loads(metrics_path.read_text())
    gold = [m["objective/gold_reward"] for m in history]
    assert (gold[-1] + gold[-2]) / 2 - (gold[0] + gold[1]) / 2 >= 0.3, gold
    return history

