"""Training through the vLLM rollout engine, as a user runs it: `rlhf train --set rollout.engine=vllm` starts the
rollout server (.venv-vllm) beside the actor's ranks, sends it the actor's weights before the first rollout and after
every update, and the run learns the shipped task by the margin of the native learning test; the held-out eval samples
through the same engine. Synchronous (k=0), every batch is sampled with the current weights; with asynchronous
rollouts (rollout.max_off_policy_steps = k) the server generates the next batches while the actor trains: staleness
never exceeds k and reaches it, and the run still learns. With deploy.rollout.replicas=2 two servers share each batch
and every one of them takes every update (each replica's own log says so), and a replica killed mid-run fails the run
naming it."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from components.launch.processes import wait_for
from tests.conftest import EVAL_SAMPLED, assert_learned_with_eval, headroom_closed

pytestmark = pytest.mark.slow(4)

RLHF = str(Path(sys.executable).parent / "rlhf")
NON_DETERMINISTIC = ("time/", "throughput/", "step_time")


def train_args(tiny_models, **overrides) -> list[str]:
    base = {"rollout.engine": "vllm", "deploy.rollout.threads": 1, "model.policy": tiny_models["policy"],
            "model.reward": tiny_models["reward"], **overrides}  # 1 thread: the suite's other worker shares the cores
    return [RLHF, "train", "--preset", "tiny",
            *[arg for key, value in base.items() for arg in ("--set", f"{key}={value}")]]


def rlhf_train(args: list[str], state: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", RLHF_STATE_DIR=str(state)))


# each algorithm, each way of gathering (one rank, two ranks on one node), one and two replicas, synchronous and not
@pytest.mark.parametrize("algorithm,ranks,replicas,k", [("rloo", 1, 2, 0), ("ppo", 2, 1, 1)])
def test_training_through_the_rollout_server_learns(tiny_models, tmp_path, algorithm, ranks, replicas, k):
    """Gold gain >= 0.3 over 12 iterations (as tests/models/test_steps.py); every iteration refitted (time/refit); the
    held-out eval samples through the same engine; nothing of the server is left afterwards. With 2 replicas, each
    replica's own log shows it applied every version the trainer made, 1 (before the first rollout) to 13, in order.

    k=1: the server generates the next batch while the actor trains: staleness 0 on the first batch (asked for with
    the initial weights), then exactly 1 (really one step off, never more); the truncated importance weights corrected
    a real mismatch (the trainer's logprobs differ from the stale engine's by far more than float32 noise).
    k=0 (the default) is the synchronous step: every batch is sampled after the refit of the update before it, so
    nothing is stale (staleness 0 every iteration) and the engine's logprobs of the sampled tokens equal the trainer's
    (float32: diff < 1e-4, against > 1e-2 for the stale k=1 batches; mismatch/token_mult_prob_error < 1.1 and
    mismatch/gen_kl < 1e-3, NeMo-RL's gates), and the run goes on moving the policy (KL > 0)."""
    metrics, evals, state = tmp_path / "m.json", tmp_path / "e.json", tmp_path / "state"
    proc = rlhf_train(train_args(tiny_models, **{
        "algorithm": algorithm, "deploy.actor.nproc_per_node": ranks, "iterations": 12,
        "rollout.max_off_policy_steps": k,
        "deploy.rollout.replicas": replicas, "run_name": f"k{k}-{algorithm}-{ranks}", **EVAL_SAMPLED})
        + ["--metrics-out", str(metrics), "--eval-out", str(evals)], state)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    history = assert_learned_with_eval(metrics, evals)
    gold = [m["objective/gold_reward"] for m in history]
    print(f"{algorithm}, {ranks} rank(s), {replicas} replica(s), k={k}: closed "
          f"{headroom_closed(sum(gold[:2]) / 2, sum(gold[-2:]) / 2):.2f} of the headroom")
    assert {m["dist/world_size"] for m in history} == {float(ranks)}
    assert all(m["time/refit"] > 0 for m in history)
    assert all("time/rollout_wait" in m and "time/engine_idle" in m for m in history)
    if k:
        assert [m["rollout/staleness_max"] for m in history] == [0.0] + [1.0] * 11
        assert [m["rollout/staleness_mean"] for m in history] == [0.0] + [1.0] * 11
        # stale: the correction had work to do
        assert max(m["sampling/sampling_logp_difference/max"] for m in history[1:]) > 1e-2
    else:
        assert all(m["rollout/staleness_max"] == 0 and m["sampling/sampling_logp_difference/max"] < 1e-4
                   for m in history), history
        assert history[-1]["objective/kl"] > 0
        # NeMo-RL's nightly gates on the engine/trainer mismatch hold with room to spare (float32 engine)
        assert all(1 <= m["mismatch/token_mult_prob_error"] < 1.1 and abs(m["mismatch/gen_kl"]) < 1e-3
                   and m["mismatch/clipped_frac"] == 0 for m in history), history
    logs = state / "runs" / f"k{k}-{algorithm}-{ranks}" / "logs"
    names = ["rollout-server.log"] if replicas == 1 else [f"rollout-server-{i}.log" for i in range(replicas)]
    for name in names:
        log = (logs / name).read_text()
        assert "engine loaded" in log and "stopped with code" in log
        assert [int(v) for v in re.findall(r"weights version (\d+) applied", log)] == list(range(1, 14)), name
    assert not leftovers(state)


def test_k2_reaches_its_bound_and_a_killed_rollout_replica_fails_the_run_naming_it(tiny_models, tmp_path):
    """k=2 on 2 replicas: staleness 0, 1, then 2, never more (the iterations `rlhf train` prints). Then kill -9 of
    replica 1 while batches are in flight: `rlhf train` fails with the replica named (pid, address, exit code; the
    seconds it took are printed: within 60 s here), and no process of the run is left."""
    state = tmp_path / "state"
    proc = subprocess.Popen(train_args(tiny_models, **{"algorithm": "rloo", "iterations": 500,
                                                       "rollout.max_off_policy_steps": 2,
                                                       "deploy.rollout.replicas": 2}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1", RLHF_STATE_DIR=str(state)))
    try:
        lines = []
        while not any("iteration 3/500" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "".join(lines[-50:])
            lines.append(line)
        staleness = [float(line.rsplit("staleness ", 1)[1]) for line in lines
                     if re.search(r"iteration \d+/500\b", line)]
        assert staleness == [0.0, 1.0, 2.0], lines[-10:]
        pid = int(next(re.search(r"rollout server replica 1: pid (\d+)", line).group(1) for line in lines
                       if "rollout server starting: " in line))  # every replica's pid, url and log on that line
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=300)
        print(f"the run failed {time.monotonic() - killed:.1f} s after its rollout server replica 1 was killed")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    reason = out.strip().splitlines()[-1]
    assert re.search(rf"rollout server replica 1 \(pid {pid}, http://[^)]+\) exited with code -9", reason), reason
    assert wait_for(lambda: not leftovers(state), 30)


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
