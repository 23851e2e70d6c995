"""Deployment-mode servers against a real Prefect server: the run's secret travels in a Secret block named per run
(the flow run's parameter is its name) and is gone when the server stops; a server's flow run serves while its run
holds the server's lease in the run's store (components/storage/lease.py), and stops once the run's process dies
without stopping it, or at once when the training flow run has ended; a server that cannot see its run's lease fails
at once, saying why."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prefect import flow, get_client
from prefect.testing.utilities import prefect_test_harness

from components.launch.processes import Health, ServerProcess, wait_for
from components.serving import services
from components.serving.auth import new_secret

LEASE_TIMEOUT_S = 4.0
REPO = Path(__file__).resolve().parents[3]
HOLD = """
import sys, time
from components.storage.lease import acquire
from components.storage.store import CheckpointStore
acquire(CheckpointStore.from_uri(sys.argv[1]), "the run", sys.argv[2])
print("holding", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_the_runs_secret_travels_in_a_block_named_per_run_and_is_deleted(prefect_api):
    secret = new_secret()
    name = services.secret_block_name("My Run_1.b")
    assert name.startswith("rlhf-secret-my-run-1-b-") and secret not in name
    services.save_secret(name, secret)
    assert services.load_secret(name) == secret
    services.delete_secret(name)
    with pytest.raises(ValueError):
        services.load_secret(name)
    services.delete_secret(name)  # twice: nothing left, no error


@flow(name="lease-probe")
def hosted(log_path: str, lease: str | None = None, training_flow_run_id: str | None = None) -> str:
    """What host_server does once its server is ready: publish, then serve until the run is gone."""
    server = ServerProcess("probe", [sys.executable, "-c", "import time; time.sleep(600)"], "http://127.0.0.1:9",
                           log_path, lambda: Health(True, "ok"))
    with server:
        lost = services.lease_lost(lease, training_flow_run_id, timeout_s=LEASE_TIMEOUT_S)
        return services.serve_published("probe", server, "http://127.0.0.1:9", lost, poll_s=0.2)


def published_flow_run() -> str | None:
    """The id of the flow run that published an address (services.address_variable)."""
    with get_client(sync_client=True) as client:
        names = [v.name for v in client.read_variables()]
    found = [n for n in names if n.startswith("rlhf_server_")]
    if not found:
        return None
    raw = found[0].removeprefix("rlhf_server_")
    return f"{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


def test_a_server_serves_while_its_run_holds_its_lease_and_stops_once_the_run_dies(prefect_api, tmp_path):
    store, key = tmp_path / "store", f"{services.SERVER_LEASES}/probe-1"
    run = subprocess.Popen([sys.executable, "-c", HOLD, str(store), key], cwd=REPO, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)})  # the run, holding the server's lease
    try:
        assert run.stdout.readline().strip() == "holding"
        result: dict = {}
        lease = f"{store.as_uri()}/{key}"
        thread = threading.Thread(target=lambda: result.update(why=hosted(str(tmp_path / "probe.log"), lease)),
                                  daemon=True)
        thread.start()
        server_run = wait_for(published_flow_run, 60, poll_s=0.1)
        assert server_run, "the server flow run never published its address"
        thread.join(2.0)  # ten looks at the lease: the run holds it, the server serves
        assert thread.is_alive() and "why" not in result
        os.kill(run.pid, signal.SIGKILL)  # the run dies: nobody releases the lease, nobody cancels the server
        run.wait()
        thread.join(30)
        assert not thread.is_alive(), "the server kept serving a dead run"
        assert f"its run's lease ({lease}) is gone" in result["why"], result
        assert published_flow_run() is None  # unpublished
    finally:
        run.kill()
        run.wait()
    with pytest.raises(RuntimeError, match=r"this server's run holds no lease at .* the run is gone, or its checkpoint "
                                           r"store \(deploy.checkpoint.uri\) is not one this server reaches"):
        services.lease_lost(lease)


def test_a_server_stops_at_once_when_its_training_flow_run_has_ended(prefect_api, tmp_path):
    @flow(name="training-probe")
    def training() -> None:
        return None

    state = training(return_state=True)
    why = hosted(str(tmp_path / "probe.log"), training_flow_run_id=str(state.state_details.flow_run_id))
    assert why == f"its training flow run {state.state_details.flow_run_id} ended (Completed)"
