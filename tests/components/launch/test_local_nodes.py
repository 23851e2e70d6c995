"""The actor's node groups on this machine (components/launch/nodes.LocalNodes), with a small job in place of the
run: every group is a real torchrun over loopback; each rank gets the environment JobSet gives a pod, a state
directory of its own and its group's cores; a failure no restart mends fails the set at once, naming the group; a
controller killed with SIGKILL leaves no process."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path


from components.launch.nodes import NO_RESTART_EXIT_CODE, LocalNodes, NodeSpec, core_share
from components.launch.processes import free_port, wait_for
from tests.conftest import run_processes

JOB = str(Path(__file__).with_name("node_job.py"))
SECRET = "the-run-secret-its-ranks-prove"  # handed to every group in its environment, never in its spec


def spec(out: Path, mode: str, max_restarts: int = 1) -> NodeSpec:
    return NodeSpec("rlhf-test-0a1b2c", 2, 1, free_port("127.0.0.1", 0), [JOB, str(out), mode],
                    {"NODE_JOB_TOKEN": "given"}, max_restarts)


def ranks_seen(out: Path, rank: int) -> list[dict]:
    path = out / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def finished(nodes: LocalNodes, timeout: float = 180):
    return wait_for(lambda: (s := nodes.status()).phase in ("succeeded", "failed") and s, timeout, poll_s=0.5)


def test_each_rank_has_a_pods_environment_and_a_failure_no_restart_mends_fails_every_group_at_once(tmp_path):
    """Rank 1 exits with NO_RESTART_EXIT_CODE: the set fails at once (no restart of the 3 allowed), naming node group 1,
    its exit code and its log; what each rank was given is what a JobSet's pod gets, and the run's secret. (A failure a
    restart mends restarts every group: tests/components/test_controller_runs.py kills one mid-run.)"""
    out, state = tmp_path / "out", tmp_path / "nodes"
    out.mkdir()
    nodes = LocalNodes(spec(out, "no-restart", max_restarts=3), tmp_path / "logs", state, SECRET)
    try:
        nodes.start()
        status = finished(nodes)
        assert status.phase == "failed" and status.restarts == 0 and status.failed_group == 1, status
        assert status.message.startswith("node group 1 (pid ") and f"exited with code {NO_RESTART_EXIT_CODE}" in \
            status.message, status.message
        assert f"last lines of {tmp_path / 'logs' / 'node-1.log'}" in status.message
    finally:
        nodes.delete()
    assert nodes.status() == status  # final: asking again starts nothing
    cores = sorted(os.sched_getaffinity(0))
    for rank in (0, 1):
        [seen] = ranks_seen(out, rank)  # one attempt: nothing restarted
        assert seen == {**seen, "JOBSET_NAME": "rlhf-test-0a1b2c", "REPLICATED_JOB_NAME": "node", "JOB_INDEX": "0",
                        "JOB_COMPLETION_INDEX": str(rank), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "RLHF_STATE_DIR": str(state / str(rank)),
                        "NODE_JOB_TOKEN": "given", "RLHF_RUN_SECRET": SECRET}, seen
        assert seen["cores"] == core_share(rank, 2, cores)  # its group's share, as a pod has its node's
        assert seen["RLHF_PARENT_PID"] == str(seen["parent"])  # a rank dies with its group's torchrun
    assert not run_processes(state)


CONTROLLER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from tests.components.launch.test_local_nodes import spec
from components.launch.nodes import LocalNodes
nodes = LocalNodes(spec(Path(sys.argv[1]), "sleep"), Path(sys.argv[2]), Path(sys.argv[3]), "a-secret-of-the-test-run")
nodes.start()
print("started", flush=True)
time.sleep(600)
"""


def test_a_controller_killed_with_sigkill_leaves_no_process_of_its_groups(tmp_path):
    out, state = tmp_path / "out", tmp_path / "nodes"
    out.mkdir()
    repo = str(Path(__file__).resolve().parents[3])
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER, str(out), str(tmp_path / "logs"), str(state),
                                   repo],
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": repo})
    try:
        assert controller.stdout.readline().strip() == "started"
        assert wait_for(lambda: ranks_seen(out, 0) and ranks_seen(out, 1), 120, poll_s=0.5)  # every rank runs
        assert len(run_processes(state)) >= 4  # two torchruns and their ranks
        controller.send_signal(signal.SIGKILL)
        controller.wait()
        assert wait_for(lambda: not run_processes(state), 60, poll_s=0.5), run_processes(state)
    finally:
        controller.kill()
        controller.wait()
        for p in run_processes(state):
            p.kill()
