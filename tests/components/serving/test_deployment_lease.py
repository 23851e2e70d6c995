"""Deployment-mode servers against a real Prefect server: the run's secret travels in a Secret block named per run
(the flow run's parameter is its name) and is gone when the server stops; a server's flow run serves while its run
renews the lease, and stops within the lease's timeout once the run dies without stopping it, or at once when the
training flow run has ended."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from prefect import flow, get_client
from prefect.runtime import flow_run
from prefect.testing.utilities import prefect_test_harness

from components.launch.processes import Health, ServerProcess, wait_for
from components.serving import services
from components.serving.auth import new_secret

LEASE_TIMEOUT_S = 4.0


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
def hosted(log_path: str, training_flow_run_id: str | None = None) -> str:
    """What host_server does once its server is ready: publish, then serve until the run is gone."""
    server = ServerProcess("probe", [sys.executable, "-c", "import time; time.sleep(600)"], "http://127.0.0.1:9",
                           log_path, lambda: Health(True, "ok"))
    with server:
        lost = services.lease_lost(flow_run.get_id(), training_flow_run_id, timeout_s=LEASE_TIMEOUT_S)
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


def test_a_server_serves_while_its_run_renews_and_stops_in_bounded_time_after_the_run_dies(prefect_api, tmp_path):
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(why=hosted(str(tmp_path / "probe.log"))), daemon=True)
    thread.start()
    server_run = wait_for(published_flow_run, 60, poll_s=0.1)
    assert server_run, "the server flow run never published its address"
    lease = services.RunLease(server_run, renew_s=0.5)  # what DeploymentServer holds for its run
    thread.join(2 * LEASE_TIMEOUT_S)  # twice the timeout: the renewals keep it serving
    assert thread.is_alive() and "why" not in result
    lease._stop.set()  # the run is SIGKILLed: no more renewals, and nobody cancels the server's flow run
    died = time.monotonic()
    thread.join(LEASE_TIMEOUT_S + 30)
    assert not thread.is_alive(), "the server kept serving a dead run"
    assert time.monotonic() - died < LEASE_TIMEOUT_S + 30
    assert f"was not renewed for {LEASE_TIMEOUT_S:.0f}s" in result["why"], result
    assert published_flow_run() is None  # unpublished


def test_a_server_stops_at_once_when_its_training_flow_run_has_ended(prefect_api, tmp_path):
    @flow(name="training-probe")
    def training() -> None:
        return None

    state = training(return_state=True)
    why = hosted(str(tmp_path / "probe.log"), training_flow_run_id=str(state.state_details.flow_run_id))
    assert why == f"its training flow run {state.state_details.flow_run_id} ended (Completed)"
