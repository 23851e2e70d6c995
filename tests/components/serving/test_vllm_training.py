"""Training through the vLLM rollout engine, as a user runs it: `rlhf train --set rollout.engine=vllm` starts the
rollout server (.venv-vllm) beside the actor's ranks, sends it the actor's weights before the first rollout and after
every update, and the run learns the shipped task by the margin of the native learning test; the held-out eval samples
through the same engine."""

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import assert_learned_with_eval

RLHF = str(Path(sys.executable).parent / "rlhf")


@pytest.mark.parametrize("algorithm,ranks", [("rloo", 1), ("rloo", 2), ("ppo", 1), ("ppo", 2)])
def test_training_through_the_vllm_engine_learns(tiny_models, tmp_path, algorithm, ranks):
    """Gold gain >= 0.3 over 12 iterations (as tests/models/test_steps.py); every iteration refitted (time/refit) and
    the engine agreed with the trainer on the sampled tokens (float32 on both sides: logprob_diff_max < 1e-4 (seen: 4e-6 to 2e-5), so
    truncated importance sampling changed next to nothing); nothing of the server is left afterwards."""
    metrics, evals = tmp_path / "m.json", tmp_path / "e.json"
    state = tmp_path / "state"
    overrides = {"algorithm": algorithm, "actor.nproc_per_node": ranks, "iterations": 12,
                 "rollout.engine": "vllm", "rollout.vllm.threads": 1, "model.policy": tiny_models["policy"],
                 "model.reward": tiny_models["reward"], "eval.prompts": "builtin:sentiment", "eval.every": 6}
    args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    proc = subprocess.run([RLHF, "train", *args, "--metrics-out", str(metrics), "--eval-out", str(evals)],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", RLHF_STATE_DIR=str(state)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the held-out eval through the engine (greedy: temperature 0 on the server)
    history = assert_learned_with_eval(metrics, evals)
    assert {m["dist/world_size"] for m in history} == {float(ranks)}
    assert all(m["time/refit"] > 0 for m in history)
    assert max(m["rollout/logprob_diff_max"] for m in history) < 1e-4, [m["rollout/logprob_diff_max"] for m in history]
    assert all(abs(m["rollout/tis_weight_mean"] - 1) < 1e-3 for m in history)
    log = (state / "logs" / "train" / "rollout-server.log").read_text()
    assert "engine loaded" in log and "stopped with code" in log
    assert not leftovers(state)


def leftovers(state: Path) -> list[psutil.Process]:
    """Live processes started for this run (their environment names its state directory)."""
    found = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get("RLHF_STATE_DIR") == str(state):
                found.append(p)
        except psutil.Error:
            continue
    return found
