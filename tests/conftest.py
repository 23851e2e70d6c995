"""Shared fixtures: quiet, offline environment and the tiny models built once per test session."""

import json
import os
import uuid
from pathlib import Path

import psutil
import pytest

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# The deployment's store key every checkpoint store of the tests signs and checks its records with (as a deployment
# sets it for all its processes; components/storage/signing.py), so no test writes a key file into the home directory;
# the tests of where the key comes from set their own.
os.environ.setdefault("RLHF_STORE_KEY", "tests-" + uuid.uuid4().hex)
# One torch/OpenMP thread per process (set before anything imports torch; every server, rank and flow run the tests
# start inherits it): two pytest workers and their servers share the cores, and on the tiny models a second intra-op
# thread only adds overhead (tests/models/test_steps.py's learning runs: 90 s -> 59 s on 2 cores with one process).
# Where the code sets threads itself (the rollout server's OMP_NUM_THREADS, distributed ranks), that still holds.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The local stacks the tests start run their flow runs as forks of a preloaded process (~11 CPU-s less per run;
# components/launch/flow_runs.py), as `rlhf up` does by default: said here too, so the suite's speed never rests on
# that default alone.
os.environ.setdefault("RLHF_FORK_FLOW_RUNS", "1")


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
    """Modules marked slow(minutes) first, the longest first (the minutes a module takes on one worker of a fresh-clone
    CI run, 2 cores), so that pytest-xdist's `--dist loadfile --no-loadscope-reorder` hands them out longest-first and
    the short modules fill the other worker around them (xdist's default order, by test count, started the two
    longest modules last). The order inside a module is kept."""
    def minutes(item) -> float:
        mark = item.get_closest_marker("slow")
        return (mark.args[0] if mark.args else 1) if mark else 0

    items.sort(key=lambda item: -minutes(item))


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with tests/flows/ as one unit: its modules share one local stack (tests/flows/conftest.py), so
    one worker runs them one after the other and the suite starts one stack, not one per module."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # only where xdist schedules

    class PackageStack(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "tests/flows" if scope.startswith("tests/flows/") else scope

    return PackageStack(config, log)


def free_port_block(n: int = 3) -> int:
    """A base port p with p..p+n-1 free on 127.0.0.1, drawn as the runs' own ports are (components/launch/processes.
    find_free_ports): outside the kernel's ephemeral range, where no outgoing connection or bind(0) of another test
    takes one between now and its bind (a torchrun rank store listens at --master_port + 1: both must stay free)."""
    from components.launch.processes import find_free_ports

    return find_free_ports("127.0.0.1", n)


def free_port() -> int:
    """A loopback port nobody listens on right now, outside the ephemeral range (free_port_block)."""
    return free_port_block(1)


GOLD_BEST = 1.0  # the shipped task's gold reward (sentiment polarity, and the 0/1 targeted reward) is at most 1


def headroom_closed(start: float, end: float, best: float = GOLD_BEST) -> float:
    """The share of what was left to gain that a run gained, (end - start) / (best - start): a learning check that
    holds wherever the run starts (another CPU's kernels move the start, never the ceiling)."""
    return (end - start) / (best - start)


def assert_learned(gold: list[float], share: float = 0.3) -> float:
    """The training gold reward, its mean over the last 2 iterations against the first 2, closed at least `share` of
    the headroom. Why 0.3: the gold reward has std ~0.75 at the start, a mean over 2 iterations of 64 rollouts a
    standard error of ~0.07, so a difference of two such means ~0.09; from a start of ~0.1, 0.3 of the headroom is
    ~0.27, about 3 standard errors above noise (seen on the shipped models, seed 0, tests/models/test_steps.py on an
    AVX-512 Xeon: 0.66 for PPO, 0.57 for RLOO)."""
    start, end = sum(gold[:2]) / 2, sum(gold[-2:]) / 2
    closed = headroom_closed(start, end)
    assert closed >= share, f"closed {closed:.2f} of the headroom (< {share}): {gold}"
    return closed


EVAL_SAMPLED = {"eval.prompts": "builtin:sentiment", "eval.every": 6, "eval.temperature": 1.0,
                "eval.samples_per_prompt": 4}
# The held-out eval of the learning checks: the task's 40 test prompts, 4 samples each at temperature 1 (greedy decoding
# of the shipped policy already writes positive reviews: its greedy gold reward starts at ~0.95, where no rise can
# show).


def assert_learned_with_eval(metrics_path: Path, evals_path: Path) -> list[dict]:
    """What an `rlhf train --metrics-out M --eval-out E` run of 12 iterations with EVAL_SAMPLED must show: the held-out
    eval at 0, 6 and 12 over the 40 test prompts x 4 samples, closing >= 0.2 of its headroom, and the training gold
    reward learned as `assert_learned` says. Returns the per-iteration metrics."""
    evals = json.loads(evals_path.read_text())
    assert [e["iteration"] for e in evals] == [0, 6, 12] and {e["eval/samples"] for e in evals} == {160.0}
    closed = headroom_closed(evals[0]["eval/gold_reward"], evals[-1]["eval/gold_reward"])
    assert closed >= 0.2, (closed, evals)
    history = json.loads(metrics_path.read_text())
    assert_learned([m["objective/gold_reward"] for m in history])
    return history


def run_processes(state: Path) -> list:
    """Live processes of a run started with RLHF_STATE_DIR=`state`: its own, its servers' and its ranks', and its node
    groups' (each has a state directory of its own below `state`). What must be gone once the run ended."""
    found = []
    for p in psutil.process_iter():
        try:
            where = p.environ().get("RLHF_STATE_DIR", "")
            if (where == str(state) or where.startswith(f"{state}/")) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found

