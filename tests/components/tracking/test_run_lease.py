"""One writer per run name, on a local store and on S3 (moto server): a second live run of the name is refused naming
the holder and touches nothing of the live run; a holder that died is taken over (at once locally: the kernel drops
its lock; after the timeout on S3) and that is said; a run whose S3 lease was taken over writes nothing more, and a
holder fenced out of its store cannot move latest.json, even mid-save; a multi-node run's rank 0 writes under its
controller's lease while the lease names it; run names that would leave the state directory or the store are
refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from pydantic import ValidationError

from components.cli.main import main as cli_main
from components.launch.processes import wait_for
from components.storage.lease import LEASE_KEY, HeldLease, LeaseLost, RunLocked, acquire
from components.storage.store import CheckpointStore
from components.runs import JOBS, open_session
from models.config import RLHFConfig, RunConfig

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def cfg(tmp_path, mlflow_uri):
    return RLHFConfig.model_validate({"run_name": "twice", "deploy": {
        "state_dir": str(tmp_path / "state"), "tracking": {"uri": mlflow_uri, "system_metrics": False}}})


def test_a_second_run_of_a_live_name_is_refused_and_touches_nothing(cfg):
    first = open_session(JOBS["rl"], cfg)
    (first.critic_dir / "model").mkdir(parents=True)
    (first.critic_dir / "model" / "weights.bin").write_bytes(b"live")
    with pytest.raises(RunLocked, match=rf"run_name='twice' is being written by pid {os.getpid()} on "):
        open_session(JOBS["rl"], cfg)
    assert (first.critic_dir / "model" / "weights.bin").read_bytes() == b"live"  # the live run's critic is intact
    first.close("FINISHED")
    second = open_session(JOBS["rl"], cfg)  # released at close: the name is free again, and its new writer cleans up
    assert not (first.critic_dir / "model").exists()
    second.close("FINISHED")


HOLD = """
import sys, time
from components.storage.lease import acquire
from components.storage.store import CheckpointStore
store = CheckpointStore.from_uri(sys.argv[1], s3_endpoint_url=sys.argv[2] or None)
acquire(store, "held", timeout_s=float(sys.argv[3]))
print("holding", flush=True)
time.sleep(600)
"""


def hold_in_a_process(uri: str, endpoint: str | None, timeout_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, uri, endpoint or "", str(timeout_s)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def test_a_killed_holder_of_a_local_store_is_taken_over_at_once_and_said(tmp_path):
    uri = str(tmp_path / "store")
    holder = hold_in_a_process(uri, None, 60)
    store = CheckpointStore.from_uri(uri)
    with pytest.raises(RunLocked, match=rf"pid {holder.pid} on "):
        acquire(store, "held")
    os.kill(holder.pid, signal.SIGKILL)  # no chance to release: the kernel drops its lock
    holder.wait()
    said: list[str] = []
    lease = acquire(store, "held", log=said.append)
    assert said and f"took over the lease of pid {holder.pid}" in said[0] and "that process is gone" in said[0]
    lease.release()
    assert not (tmp_path / "store" / LEASE_KEY).exists()


def test_s3_one_writer_a_stale_lease_taken_over_and_a_lost_lease_stops_writing(s3_bucket):
    endpoint, bucket = s3_bucket
    uri = f"s3://{bucket}/runs/held"
    store = CheckpointStore.from_uri(uri, s3_endpoint_url=endpoint)
    holder = hold_in_a_process(uri, endpoint, 5.0)
    try:
        with pytest.raises(RunLocked, match=rf"pid {holder.pid} on .*renewed \d+s ago"):
            acquire(store, "held", timeout_s=5.0)
        os.kill(holder.pid, signal.SIGKILL)  # its renewals stop; the object stays behind
        holder.wait()
        said: list[str] = []

        def taken():
            try:
                return acquire(store, "held", timeout_s=5.0, log=said.append)
            except RunLocked:
                return None

        lease = wait_for(taken, 30, poll_s=1.0)  # refused until the lease is 5 s old by S3's own clock
        assert lease is not None and f"took over the lease of pid {holder.pid}" in said[0], said
        lease.check()  # ours now
        # another run takes it over behind our back (as if we had stalled past the timeout): we stop writing
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.put_object(Bucket=bucket, Key="runs/held/lease.json",
                      Body=json.dumps({"name": "held", "host": "elsewhere", "pid": 1, "started": "now"}))
        lost = wait_for(lambda: lease.lost, 30, poll_s=0.2)
        assert lost and "taken over by pid 1 on elsewhere" in lost
        with pytest.raises(LeaseLost, match="writes nothing more"):
            lease.check()
        lease.release()  # not ours any more: left in place for its holder
        assert json.loads(s3.get_object(Bucket=bucket,
                                        Key="runs/held/lease.json")["Body"].read())["host"] == "elsewhere"
    finally:
        holder.kill()
        holder.wait()


def fenced_out(store: CheckpointStore, tmp_path: Path) -> None:
    """A holder whose lease was taken over cannot commit: the next holder fenced the store (before or during the old
    holder's save), so latest.json stays where the new holder put it, and the old one fails naming why."""
    old = acquire(store, "fenced")
    store.fence(old.token)
    part = tmp_path / "part"
    part.mkdir(exist_ok=True)
    (part / "weights.bin").write_bytes(b"w" * 1000)
    store.save(1, {"actor": part}, {"by": "old"}, fence=old.token)
    assert store.latest() == 1
    new_token = "another-holder"
    store.fence(new_token)  # taken over while the old holder stalled (S3), and fenced at once
    with pytest.raises(LeaseLost, match=r"latest.json names another writer .* iteration 2 is not committed"):
        store.save(2, {"actor": part}, {"by": "old"}, fence=old.token)  # refused before its upload
    store.fence(old.token)  # the old holder's fence again, to race it mid-save:
    with pytest.raises(LeaseLost, match=r"iteration 3 \(iter_3-.*\) is not committed"):
        store.save(3, {"actor": part}, {"by": "old"}, fence=old.token, _after_file=lambda rel: store.fence(new_token))
    pointer = json.loads(store._backend.get_bytes("latest.json"))
    assert (pointer["iteration"], pointer["fence"]) == (1, new_token)  # latest.json never moved for the old holder
    assert store.restore(tmp_path / "restored")[1] == {"by": "old"} and store.latest() == 1
    store.save(2, {"actor": part}, {"by": "new"}, fence=new_token)  # the new holder commits
    assert store.latest() == 2
    old.release()


def test_a_fenced_out_holder_cannot_commit_locally(tmp_path):
    fenced_out(CheckpointStore.from_uri(str(tmp_path / "store")), tmp_path)


def test_a_fenced_out_holder_cannot_commit_on_s3(s3_bucket, tmp_path):
    endpoint, bucket = s3_bucket
    fenced_out(CheckpointStore.from_uri(f"s3://{bucket}/runs/fenced", s3_endpoint_url=endpoint), tmp_path)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_node_group_writes_under_its_controllers_lease_only_while_the_controller_holds_it(where, tmp_path, s3_bucket):
    """The controller (here a process of its own) holds the lease; rank 0, in another process, opens the run under
    it: refused nothing, releasing nothing. Once the controller is gone and another run takes the name, rank 0's next
    check fails (LeaseLost naming the new holder) instead of writing over it."""
    endpoint, bucket = s3_bucket
    uri, endpoint = (f"s3://{bucket}/runs/held", endpoint) if where == "s3" else (str(tmp_path / "store"), None)
    store = CheckpointStore.from_uri(uri, s3_endpoint_url=endpoint)
    controller = hold_in_a_process(uri, endpoint, 5.0)
    try:
        held = HeldLease(store, "held", store.get_json(LEASE_KEY)["id"])  # the id the hand-off carries
        held.check()
        held.release()  # not its to release
        held.check()
        with pytest.raises(LeaseLost, match=rf"run held: its lease in .* is held by pid {controller.pid} on .*, not "
                                            r"by this run's controller \(holder another-holder-id\)"):
            HeldLease(store, "held", "another-holder-id")
    finally:
        controller.kill()
        controller.wait()
    other = wait_for(lambda: _try_acquire(store), 30, poll_s=1.0)  # the controller is gone: another run takes over
    try:
        with pytest.raises(LeaseLost, match=rf"is held by pid {os.getpid()} on .*writes nothing more"):
            held.check()
    finally:
        other.release()


def _try_acquire(store):
    try:
        return acquire(store, "held", timeout_s=5.0)
    except RunLocked:
        return None


def test_two_runs_starting_at_once_on_s3_get_one_lease(s3_bucket):
    endpoint, bucket = s3_bucket
    store = CheckpointStore.from_uri(f"s3://{bucket}/runs/race", s3_endpoint_url=endpoint)
    first = acquire(store, "race")
    with pytest.raises(RunLocked):
        acquire(store, "race")
    first.release()
    acquire(store, "race").release()


BAD_NAMES = ["../x", "../../escape", "/abs/path", "a/b", "..", ".hidden", "x" * 101, "spa ce", "C:\\x"]


def test_run_names_that_leave_the_state_dir_or_the_store_are_refused():
    for name in BAD_NAMES:
        for model in (RunConfig, RLHFConfig):
            with pytest.raises(ValidationError, match="run_name"):
                model.model_validate({"run_name": name})
    # as a user types it (the probe): `rlhf config --set run_name=...`
    for name in ("../../escape", "/abs/path"):
        with pytest.raises(SystemExit, match=r"invalid config: .*\nrun_name\n  String should match pattern"):
            cli_main(["config", "--set", f"run_name={name}"])
