"""The run's controller and the node groups' seam without starting a run: which process controls a run, the JobSet
name of its node groups, what a node group runs and where it finds rank 0, the cores a local group gets, the checks
of a cluster launch, and the relay of rank 0's messages (each once, in order, its own run's only)."""

import io
import json
import re

import pytest

from components.controller import RELAY, Relay, RelaySteps, controls, shared_by_pods, spec_name
from components.launch.nodes import NodeSpec, core_share, node_argv, rank0_address
from models.config import preset
from models.loop import Steps

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`


class Recorded(Steps):
    def __init__(self):
        self.events = []

    def log(self, message):
        self.events.append(("log", message))

    def table(self, key, rows, description):
        self.events.append(("table", key, rows, description))

    def progress(self, done, total, what):
        self.events.append(("progress", done, total, what))


def test_a_process_controls_the_run_only_with_several_nodes_and_no_torchrun_around_it(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    one = preset("tiny", **{"deploy.state_dir": str(tmp_path)})
    two = preset("tiny", **{"deploy.state_dir": str(tmp_path), "deploy.actor.nnodes": 2})
    assert not controls(one) and controls(two)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a rank torchrun started (the actor's pods before the controller) runs it
    monkeypatch.setenv("RANK", "0")
    assert not controls(two)


def test_the_node_groups_name_is_a_short_dns_label_unique_per_run_name():
    names = {run: spec_name(run) for run in ("ppo-20261127-141502-ab12", "PPO 20261127/141502:ab12",
                                             "x" * 200, "Ω", "ppo-20261127-141502-ab13")}
    for run, name in names.items():
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", name), (run, name)  # a JobSet's name (<= 40)
    assert len(set(names.values())) == len(names)  # runs differing past the slug, or only in case, stay apart
    assert spec_name("ppo-1") == spec_name("ppo-1")


def test_a_node_group_runs_torchrun_for_its_node_with_the_specs_command():
    spec = NodeSpec("rlhf-x-123abc", 4, 8, 29500, ["-m", "components.runs", "--store", "s3://b/p/run"])
    assert node_argv(spec, python="python") == [
        "python", "-m", "components.launch.nodes", "--nnodes", "4", "--nproc-per-node", "8", "--master-port", "29500",
        "--", "-m", "components.runs", "--store", "s3://b/p/run"]


def test_rank_0_is_found_at_master_addr_or_else_at_pod_0_of_the_jobset():
    jobset = {"JOBSET_NAME": "rlhf-x-123abc", "REPLICATED_JOB_NAME": "node", "JOB_INDEX": "0",
              "JOB_COMPLETION_INDEX": "3"}
    assert rank0_address(jobset) == "rlhf-x-123abc-node-0-0.rlhf-x-123abc"
    assert rank0_address({**jobset, "MASTER_ADDR": "127.0.0.1"}) == "127.0.0.1"


def test_local_groups_share_the_cores_as_pods_would():
    assert [core_share(i, 2, [0, 1, 2, 3]) for i in range(2)] == [[0, 2], [1, 3]]
    assert [core_share(i, 3, [0, 1]) for i in range(3)] == [[0], [1], [0]]  # more groups than cores: shared
    assert core_share(0, 1, [5, 7]) == [5, 7]


def test_a_cluster_launch_refuses_a_store_or_mlflow_its_pods_cannot_reach():
    shared_by_pods("s3://bucket/checkpoints", "http://mlflow:5000")
    with pytest.raises(ValueError, match=r"^deploy\.checkpoint\.uri: file:///tmp/c is a local directory.*s3://"):
        shared_by_pods("file:///tmp/c", "http://mlflow:5000")
    with pytest.raises(ValueError, match=r"^deploy\.tracking\.uri: sqlite:////tmp/m\.db is local to this pod"):
        shared_by_pods("s3://bucket/checkpoints", "sqlite:////tmp/m.db")


def test_the_relay_passes_each_message_table_and_progress_once_in_order_and_only_its_own():
    out = io.StringIO()
    rank0 = RelaySteps("c0ffee01", {"prefect.flow_run_id": "f"}, out=out)
    rank0.log("run r: new run")
    rank0.progress(1, 12, "iterations")
    rank0.table("eval-r", [{"prompt": "p", "reward": 0.5}], "Held-out eval")
    rank0.log("iteration 1/12:\nsecond line")
    lines = out.getvalue().splitlines()
    assert all(line.startswith(f"{RELAY} c0ffee01.") for line in lines) and rank0.tags() == {"prefect.flow_run_id": "f"}

    steps = Recorded()
    relay = Relay(steps, "c0ffee01")
    other = RelaySteps("deadbeef", out=io.StringIO())  # an earlier run's rank 0 in the same log
    other.log("not ours")
    noise = ["[rank1]: torch warning", other.out.getvalue().strip()]
    relay.take("\n".join(noise + lines[:2]))
    relay.take("\n".join(lines[:3]))  # a look sees the last lines again
    relay.take("\n".join(lines))
    assert steps.events == [("log", "run r: new run"), ("progress", 1, 12, "iterations"),
                            ("table", "eval-r", [{"prompt": "p", "reward": 0.5}], "Held-out eval"),
                            ("log", "iteration 1/12:\nsecond line")]

    # a restarted attempt numbers from 0 again under a new attempt id; a line lost between looks is said
    again = RelaySteps("c0ffee01", out=io.StringIO())
    for i in range(4):
        again.log(f"attempt 2 message {i}")
    second = again.out.getvalue().splitlines()
    relay.take("\n".join(second[:1] + second[2:3] + ["rlhf-relay c0ffee01.0a0b0c 9 {not json"]))
    assert steps.events[4:] == [("log", "attempt 2 message 0"),
                                ("log", "(1 message(s) of node group 0 were not relayed: see its log)"),
                                ("log", "attempt 2 message 2")]


def test_a_relayed_event_that_fails_is_said_and_the_relay_goes_on():
    class Broken(Recorded):
        def table(self, key, rows, description):
            raise ConnectionError("the API is down")

    steps = Broken()
    rank0 = RelaySteps("aa", out=io.StringIO())
    rank0.table("k", [], "d")
    rank0.log("after")
    Relay(steps, "aa").take(rank0.out.getvalue())
    assert steps.events == [("log", "could not relay ['table'] of node group 0: ConnectionError: the API is down"),
                            ("log", "after")]
    assert json.loads(rank0.out.getvalue().splitlines()[0].split(" ", 3)[3]) == {
        "table": {"key": "k", "rows": [], "description": "d"}}
