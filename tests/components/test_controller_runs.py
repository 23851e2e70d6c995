"""`rlhf train --set deploy.actor.nnodes=2` as a user runs it: `rlhf train` is the run's controller and starts two
node groups (torchrun each, over loopback, with the environment JobSet gives its pods and a state directory of its
own: the groups share nothing but the run's checkpoint store); node group 0's rank 0 runs the run and its messages
reach the console through the controller. PPO survives a node group killed mid-run (the attempt fails naming it,
every group restarts, the run resumes from its last checkpoint), learns, and runs the held-out eval on both ranks.
Nothing is left running. (The one-node launch of 2 ranks learns in
tests/components/serving/test_vllm_training.py; the first update of 2 node groups equals that of 2 ranks on one node
in tests/models/test_distributed.py.)"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from components.launch.processes import wait_for
from tests.conftest import EVAL_SAMPLED, assert_learned, headroom_closed, run_processes

pytestmark = pytest.mark.slow(2)  # a learning run on two node groups, restarted once

RLHF = str(Path(sys.executable).parent / "rlhf")


def train_args(tiny_models, **overrides) -> list[str]:
    base = {"deploy.actor.nnodes": 2, "iterations": 12, "model.policy": tiny_models["policy"],
            "model.reward": tiny_models["reward"], "deploy.tracking.system_metrics": "false", **overrides}
    return [RLHF, "train", "--preset", "tiny",
            *[arg for key, value in base.items() for arg in ("--set", f"{key}={value}")]]


def committed(latest: Path) -> int:
    """The iteration of the last checkpoint a local store's latest.json names (-1: none yet)."""
    try:
        return json.loads(latest.read_text()).get("iteration") or -1
    except (OSError, ValueError):
        return -1


def node_group(state: Path, group: int) -> psutil.Process:
    """The torchrun of node group `group` (components/launch/nodes.py main: it leads the group's processes)."""
    return next(p for p in run_processes(state) if p.environ().get("JOB_COMPLETION_INDEX") == str(group)
                and "components.launch.nodes" in " ".join(p.cmdline()))


def test_ppo_on_two_node_groups_survives_a_killed_group_resumes_from_its_checkpoint_learns_and_evaluates_on_both_ranks(
        tiny_models, tmp_path):
    """PPO (a critic beside rank 0) on 2 node groups of 1 rank. Node group 1 (its torchrun and rank) is killed with
    SIGKILL once the checkpoint of 4 is committed: the controller names it with its exit code, restarts every group,
    and the run resumes from its last checkpoint (4, or 8 had rank 0 got there first: actor and critic), each
    iteration in MLflow once; the training gold reward closes >= 0.3 of its headroom over the 12 iterations, and the
    held-out eval (40 prompts x 4 samples) runs on both ranks at 0, 6 and 12, every prompt of both ranks counted,
    closing >= 0.2 of its headroom.
    (One run for what were an RLOO run killed and a PPO run learning: the node groups' launch, kill and resume do not
    depend on the algorithm; RLOO on 2 ranks updates like 1 in tests/models/test_distributed.py and learns through
    the rollout server in tests/components/serving/test_vllm_training.py.)"""
    from mlflow.tracking import MlflowClient

    state, metrics = tmp_path / "state", tmp_path / "m.json"
    proc = subprocess.Popen(train_args(tiny_models,
                                       **{"algorithm": "ppo", "checkpoint.every": 4, "run_name": "two-nodes",
                                                       "deploy.actor.max_restarts": 1, **EVAL_SAMPLED})
                            + ["--metrics-out", str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1", RLHF_STATE_DIR=str(state)))
    lines = []
    try:
        # killed once the checkpoint of 4 is committed, read from the store itself: the relayed output lags rank 0
        # by up to a second (several iterations), so it cannot say where rank 0 is
        latest = state / "checkpoints" / "two-nodes" / "latest.json"
        reader = threading.Thread(target=lambda: lines.extend(line.split("\r")[-1] for line in proc.stdout))
        reader.start()
        assert wait_for(lambda: proc.poll() is not None or committed(latest) >= 4, 600, poll_s=0.05), lines[-60:]
        killed = node_group(state, 1)
        os.killpg(killed.pid, signal.SIGKILL)
        proc.wait(timeout=900)
        reader.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines)
    assert proc.returncode == 0, text[-4000:]
    assert "this process controls them, node group 0's rank 0 runs the run" in text
    assert re.search(rf"actor attempt 1 failed: node group 1 \(pid {killed.pid}\) exited with code -9",
                     text), text[-4000:]
    assert "restarting every node group from the run's last checkpoint (restart 1 of 1)" in text
    second = text.split("restarting every node group", 1)[1]
    resumed = re.search(r"resuming from checkpoint iteration (\d+)", second)  # the last one committed before the kill
    assert resumed and int(resumed[1]) in (4, 8), second[-6000:]
    start = int(resumed[1])
    printed = [line.split(":")[0] for line in second.splitlines() if line.startswith("iteration ")]
    assert printed == [f"iteration {i}/12" for i in range(start + 1, 13)], printed
    history = json.loads(metrics.read_text())  # what this attempt ran
    assert [m["dist/world_size"] for m in history] == [2.0] * (12 - start)
    assert history[-1]["episode"] == 12 * 64
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("rlhf-flows").experiment_id],
                               filter_string="attributes.run_name = 'two-nodes'")
    gold = sorted(client.get_metric_history(run.info.run_id, "objective/gold_reward"), key=lambda m: m.step)
    assert [m.step for m in gold] == list(range(1, 13)) and run.info.status == "FINISHED"
    print(f"PPO on 2 node groups, restarted once: closed {assert_learned([m.value for m in gold]):.2f} of the headroom")
    # the held-out eval of both attempts, each step once (0 before the kill; 12 after the resume; 6 by whichever
    # attempt got there first: the resumed one does not log it again), both ranks' prompts counted
    evals = {name: sorted(client.get_metric_history(run.info.run_id, f"eval/{name}"), key=lambda m: m.step)
             for name in ("gold_reward", "samples")}
    assert [m.step for m in evals["gold_reward"]] == [0, 6, 12], evals["gold_reward"]
    assert {m.value for m in evals["samples"]} == {160.0}, evals["samples"]
    closed = headroom_closed(evals["gold_reward"][0].value, evals["gold_reward"][-1].value)
    assert closed >= 0.2, (closed, evals["gold_reward"])
    # the groups shared nothing but the store: group 0's rank 0 downloaded the checkpoint into its own directory
    groups = state / "runs" / "two-nodes" / "nodes"
    assert (groups / "0" / "runs" / "two-nodes" / "restore" / "actor" / "optimizer.pt").exists()
    assert not (groups / "1" / "runs").exists()
    assert wait_for(lambda: not run_processes(state), 60), run_processes(state)
