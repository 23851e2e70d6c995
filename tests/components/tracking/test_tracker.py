"""Tracker against a real sqlite-backed MLflow store."""

from __future__ import annotations

import math
import socket
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from components.tracking.tracker import PARAM_VALUE_LIMIT, Tracker, TrackingError, check_reachable, resolve_tracking_uri

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`

CONFIG = {"algorithm": "ppo", "ppo": {"lr": 1e-5, "clip": {"ratio": 0.2}}, "layers": [4, 256], "prompt": "x" * 2000}


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_new_run_logs_params_tags_and_config(mlflow_uri: str, tmp_path: Path) -> None:
    with Tracker(mlflow_uri, "exp", "ppo-1", tags={"algorithm": "ppo"}, system_metrics=False) as tracker:
        run_id = tracker.start(CONFIG)
        tracker.log_steps([(0, {"objective/kl": 0.5, "reward": 1, "note": "text", "bad": None})])
        tracker.log_steps([(1, {"objective/kl": float("nan"), "loss/value_avg": 2.0})])
        tracker.log_table([{"prompt": "a", "reward": 1.0}, {"prompt": "b", "response": "c"}], step=1)
        tracker.log_checkpoint("s3://bucket/run/iter_1", step=1)

    client = MlflowClient(mlflow_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "ppo-1"
    params = run.data.params
    assert params["ppo.lr"] == "1e-05" and params["ppo.clip.ratio"] == "0.2" and params["algorithm"] == "ppo"
    assert params["layers"] == "[4, 256]"
    assert len(params["prompt"]) == PARAM_VALUE_LIMIT and params["prompt"].endswith("(truncated)")
    assert run.data.tags["algorithm"] == "ppo" and run.data.tags["mlflow.runName"] == "ppo-1"
    assert run.data.tags["checkpoint.latest"] == "s3://bucket/run/iter_1"
    assert set(run.data.metrics) == {"objective/kl", "reward", "loss/value_avg", "checkpoint/iteration"}
    kl = history(client, run_id, "objective/kl")
    assert kl[0] == (0, 0.5) and kl[1][0] == 1 and math.isnan(kl[1][1])

    local = Path(client.download_artifacts(run_id, "", str(tmp_path / "dl")))
    assert yaml.safe_load((local / "config.yaml").read_text()) == CONFIG  # full values, not truncated
    assert (local / "tables" / "samples_000001.json").is_file()
    assert (local / "checkpoints" / "000001.txt").read_text().strip() == "s3://bucket/run/iter_1"
    # artifacts live next to the database, not in the working directory
    assert run.info.artifact_uri.startswith((tmp_path / "mlartifacts").as_uri())


def test_resume_continues_run_with_increasing_steps(mlflow_uri: str) -> None:
    first = Tracker(mlflow_uri, "exp", "rloo-1", system_metrics=False)
    run_id = first.start(CONFIG)
    for step in range(3):
        first.log_steps([(step, {"objective/kl": step / 10})])
    with pytest.raises(ValueError, match="step 2 is not after the last logged step 2"):
        first.log_steps([(2, {"objective/kl": 9.0})])
    first.log_checkpoint("file:///ckpt/iter_2", step=2)
    first.end("FAILED")  # e.g. the flow run crashed

    second = Tracker(mlflow_uri, "exp", "rloo-1", run_id=run_id, system_metrics=False)
    assert second.start(CONFIG) == run_id
    assert second.last_step == 2
    with pytest.raises(ValueError, match="not after"):
        second.log_steps([(1, {"objective/kl": 1.0})])
    second.log_steps([(3, {"objective/kl": 0.3})])
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "RUNNING"
    second.end()

    client = MlflowClient(mlflow_uri)
    assert [s for s, _ in history(client, run_id, "objective/kl")] == [0, 1, 2, 3]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert len(client.search_runs([client.get_experiment_by_name("exp").experiment_id])) == 1


def test_exception_marks_run_failed(mlflow_uri: str) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with Tracker(mlflow_uri, "exp", "crash", system_metrics=False) as tracker:
            run_id = tracker.start({})
            raise RuntimeError("boom")
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "FAILED"


def test_two_trackers_in_one_process_do_not_interfere(mlflow_uri: str) -> None:
    a = Tracker(mlflow_uri, "exp", "a", system_metrics=False)
    b = Tracker(mlflow_uri, "exp", "b", system_metrics=False)
    run_a, run_b = a.start({"x": 1}), b.start({"x": 2})
    a.log_steps([(5, {"m": 1.0})])
    b.log_steps([(0, {"m": 2.0})])  # b's steps are independent of a's
    a.end()
    b.end()
    client = MlflowClient(mlflow_uri)
    assert history(client, run_a, "m") == [(5, 1.0)] and history(client, run_b, "m") == [(0, 2.0)]
    assert client.get_run(run_a).data.params["x"] == "1" and client.get_run(run_b).data.params["x"] == "2"


def test_system_metrics_are_logged(mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    tracker = Tracker(mlflow_uri, "exp", "sys", system_metrics=True)
    run_id = tracker.start({})
    client = MlflowClient(mlflow_uri)
    deadline = time.monotonic() + 120  # the monitor thread logs its first sample after one interval, later when loaded
    while "system/cpu_utilization_percentage" not in client.get_run(run_id).data.metrics:
        assert time.monotonic() < deadline, "no system metric was logged within 120 s"
        time.sleep(0.2)
    tracker.log_steps([(0, {"m": 1.0})])
    tracker.end()
    metrics = client.get_run(run_id).data.metrics
    assert "system/cpu_utilization_percentage" in metrics and "m" in metrics


def test_unreachable_http_tracking_uri_fails_fast() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    with pytest.raises(TrackingError, match=f"MLflow tracking server {uri} is unreachable"):
        Tracker(uri, "exp", "x", system_metrics=False).start({})
    with pytest.raises(TrackingError, match=uri):
        check_reachable(uri, timeout=1)


def test_resolve_tracking_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(None, tmp_path / "state") == f"sqlite:///{tmp_path / 'state' / 'mlflow.db'}"
    assert (tmp_path / "state").is_dir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert resolve_tracking_uri(None, tmp_path) == "http://mlflow.example:5000"
    assert resolve_tracking_uri("sqlite:///x.db", tmp_path) == "sqlite:///x.db"
