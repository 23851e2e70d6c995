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
def tiny_dir(tmp_path_factory) -> Path:
    """The embedded default (tiny policy, reward, critic), built once per test session by `models.tiny.ensure_tiny`
    (what a run does on first use) into one directory every test shares; set RLHF_TEST_TINY_DIR to reuse one across
    sessions. A test that needs a state directory holding the models links this one in (`link_tiny`).

    Under pytest-xdist the directory is the session's, not the worker's (the parent of the worker's base temp): the
    first worker to ask builds it under ensure_tiny's lock, the other waits for it and reuses it."""
    from models.tiny import ensure_tiny

    cached = os.environ.get("RLHF_TEST_TINY_DIR")
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return ensure_tiny(Path(cached) if cached else shared / "models" / "tiny", log=lambda *_: None)


@pytest.fixture(scope="session")
def tiny_models(tiny_dir) -> dict[str, str]:
    """Paths of the tiny policy / reward / critic (the session's build of the embedded default)."""
    return {name: str(tiny_dir / name) for name in ("policy", "reward", "critic")}


@pytest.fixture(scope="session")
def tiny_reward_chars(tiny_dir) -> str:
    """Path of tiny/reward-chars, built (once, ~55 s) beside the others only when a test asks for it."""
    from models.tiny import ensure_tiny

    ensure_tiny(tiny_dir, names=("reward-chars",), log=lambda *_: None)
    return str(tiny_dir / "reward-chars")


TINY_FIXTURES = {"tiny_dir", "tiny_models", "tiny_reward_chars"}


def pytest_collection_modifyitems(items):
    """Modules marked slow first (they start whole stacks and run for minutes), so that under pytest-xdist's
    `--dist loadfile` the longest module starts at once and the short ones fill the other worker around it; then the
    modules that need no tiny model (they run while the session's first worker builds them), then the rest. The order
    inside a module is kept."""
    needs_tiny = {item.module.__name__ for item in items if TINY_FIXTURES & set(getattr(item, "fixturenames", ()))}
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, item.module.__name__ in needs_tiny))


def link_tiny(state_dir: Path, tiny_dir: Path) -> Path:
    """Give `state_dir` the session's models without building them again: <state_dir>/models/tiny is a symlink to
    `tiny_dir`, so `tiny/<name>` resolves there (and a reward-chars built later by either side is seen by both)."""
    (state_dir / "models").mkdir(parents=True, exist_ok=True)
    (state_dir / "models" / "tiny").symlink_to(tiny_dir, target_is_directory=True)
    return state_dir


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

