"""What a server pod of a run runs (components/serving/pod.py): it refuses to start without the run's secret, and it
copies its server's log to its own output (what `kubectl logs` shows). The server itself starts through
local.local_server, tested with every server kind in tests/components/serving."""

from __future__ import annotations

import io
import threading

import pytest

from components.serving import pod
from models.config import load_config

pytestmark = pytest.mark.fast


def test_a_server_pod_without_the_runs_secret_does_not_start(monkeypatch):
    monkeypatch.delenv("RLHF_RUN_SECRET", raising=False)
    monkeypatch.delenv("RLHF_RUN_SECRET_FILE", raising=False)
    config = load_config(preset="tiny").model_dump_json()
    with pytest.raises(SystemExit, match=r"critic server: no run secret \(\$RLHF_RUN_SECRET_FILE"):
        pod.main(["critic", "--config-json", config])


def test_the_servers_log_reaches_the_pods_output(tmp_path):
    log, out, stop = tmp_path / "critic-server.log", io.StringIO(), threading.Event()
    copier = threading.Thread(target=pod.follow, args=(log, stop, out))
    copier.start()
    log.write_text("loading weights\n")
    with open(log, "a") as fh:
        fh.write("ready on 0.0.0.0:8000\n")
    stop.set()
    copier.join(timeout=10)
    assert not copier.is_alive() and out.getvalue() == "loading weights\nready on 0.0.0.0:8000\n"
