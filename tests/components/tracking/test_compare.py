"""compare_runs / log_comparison against a real sqlite-backed MLflow store."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from components.tracking.compare import compare_runs, log_comparison
from components.tracking.tracker import TrackingError, get_or_create_experiment

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`

T0 = 1_700_000_000_000  # ms


def make_run(uri: str, name: str, algorithm: str, metrics: dict[str, list[float]], *, start: int,
             finish: bool = True) -> str:
    """A run whose step i was logged at start + 2 s * (i + 1); it ends 2 s after its last step."""
    client = MlflowClient(uri)
    experiment_id = get_or_create_experiment(client, "cmp", uri)
    run = client.create_run(experiment_id, start_time=start, run_name=name, tags={"algorithm": algorithm})
    entries = [
        Metric(key, value, start + 2000 * (step + 1), step)
        for key, values in metrics.items()
        for step, value in enumerate(values)
    ]
    client.log_batch(run.info.run_id, metrics=entries)
    if finish:
        steps = max(len(v) for v in metrics.values())
        client.set_terminated(run.info.run_id, "FINISHED", end_time=start + 2000 * (steps + 1))
    return run.info.run_id


@pytest.fixture
def runs(mlflow_uri: str) -> dict[str, str]:
    ids = {
        "old-ppo": make_run(mlflow_uri, "old-ppo", "ppo", {"objective/kl": [9.0]}, start=T0),
        "ppo-run": make_run(
            mlflow_uri,
            "ppo-run",
            "ppo",
            {"objective/gold_reward": [0.1, 0.5, 0.75], "objective/kl": [0.0, 0.02, 0.04], "step_time": [1, 1, 1],
             "eval/gold_reward": [0.2, 0.6]},  # a held-out eval (plotted beside the training curves)
            start=T0 + 10_000,
        ),
        "rloo-run": make_run(  # no gold reward logged: shown as absent
            mlflow_uri, "rloo-run", "rloo", {"objective/kl": [0.0, 0.01, 0.03, 0.06], "step_time": [0.5] * 4}, start=T0
            + 20_000
        ),
        "running-rloo": make_run(mlflow_uri, "running-rloo", "rloo", {"objective/kl": [7.0]}, start=T0 + 30_000,
                                 finish=False),
    }
    return ids


def test_compare_latest_finished_run_per_algorithm(mlflow_uri: str, runs: dict[str, str], tmp_path: Path) -> None:
    png, md = compare_runs(mlflow_uri, "cmp", None, tmp_path / "out")

    assert png == tmp_path / "out" / "comparison.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 100 and image.shape[1] > 100

    text = md.read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert set(rows) == {"run", "ppo-run", "rloo-run"}  # old and unfinished runs are not picked
    ppo = [c.strip() for c in rows["ppo-run"].strip("|").split("|")]
    rloo = [c.strip() for c in rows["rloo-run"].strip("|").split("|")]
    header = [c.strip() for c in rows["run"].strip("|").split("|")]
    col = {name: i for i, name in enumerate(header)}
    assert ppo[col["run id"]] == runs["ppo-run"] and ppo[col["algorithm"]] == "ppo"
    assert ppo[col["iterations"]] == "3" and rloo[col["iterations"]] == "4"
    assert ppo[col["final objective/gold_reward"]] == "0.75" and rloo[col["final objective/gold_reward"]] == "absent"
    assert ppo[col["final objective/kl"]] == "0.04" and rloo[col["final objective/kl"]] == "0.06"
    assert ppo[col["final objective/entropy"]] == "absent"
    assert ppo[col["final eval/gold_reward"]] == "0.6" and rloo[col["final eval/gold_reward"]] == "absent"
    assert "final eval/reward" not in col  # no run logged it: no empty panel
    assert ppo[col["wall-clock (s)"]] == "8" and rloo[col["wall-clock (s)"]] == "10"


def test_compare_explicit_run_ids_and_log_comparison(mlflow_uri: str, runs: dict[str, str], tmp_path: Path) -> None:
    png, md = compare_runs(mlflow_uri, "cmp", [runs["old-ppo"], runs["running-rloo"]], tmp_path,
                           metrics=("objective/kl",))
    text = md.read_text()
    assert "old-ppo" in text and "running-rloo" in text and "| 9 |" in text and "| 7 |" in text
    assert "rloo-run" not in text

    run_id = log_comparison(mlflow_uri, "cmp", png, md)
    client = MlflowClient(mlflow_uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "compare" and run.data.tags["kind"] == "comparison"
    assert {a.path for a in client.list_artifacts(run_id)} == {"comparison.png", "comparison.md"}
    # the comparison run itself has no algorithm tag, so the default selection ignores it
    _, md2 = compare_runs(mlflow_uri, "cmp", None, tmp_path / "again")
    assert "compare |" not in md2.read_text()


def test_no_runs_names_the_experiment(mlflow_uri: str, tmp_path: Path) -> None:
    with pytest.raises(TrackingError, match="experiment 'nothing-here' does not exist"):
        compare_runs(mlflow_uri, "nothing-here", None, tmp_path)
    get_or_create_experiment(MlflowClient(mlflow_uri), "empty", mlflow_uri)
    with pytest.raises(TrackingError, match="no finished ppo/rloo/grpo/.* runs .* experiment 'empty'"):
        compare_runs(mlflow_uri, "empty", None, tmp_path)


def test_labels_name_the_runs_in_the_table(mlflow_uri: str, runs: dict[str, str], tmp_path: Path) -> None:
    """A sweep names its trials by their values (components/sweep/tracking.py); unlabelled runs keep their names."""
    _, md = compare_runs(mlflow_uri, "cmp", [runs["ppo-run"], runs["rloo-run"]], tmp_path, metrics=("objective/kl",),
                         labels={runs["ppo-run"]: "t0: lr=0.001, complete"})
    text = md.read_text()
    assert f"| t0: lr=0.001, complete | {runs['ppo-run']} |" in text and f"| rloo-run | {runs['rloo-run']} |" in text


def test_rlhf_compare_reads_its_runs_as_an_experiment_of_one_seed_per_arm(mlflow_uri: str, tmp_path: Path) -> None:
    """`rlhf compare` is the special case of an experiment with one seed per arm, on the same code
    (components/sweep/report.py): each run an arm, its IQM the run's value, no interval wider than a point, and the
    reading says one seed cannot separate arms."""
    from components.cli.main import main

    a = make_run(mlflow_uri, "arm-a", "ppo", {"eval/gold_reward": [0.2, 0.5]}, start=T0)
    b = make_run(mlflow_uri, "arm-b", "rloo", {"eval/gold_reward": [0.2, 0.7]}, start=T0 + 10_000)
    assert main(["compare", "--experiment", "cmp", "--runs", a, b, "--tracking-uri", mlflow_uri,
                 "--out", str(tmp_path)]) == 0
    text = (tmp_path / "comparison.md").read_text()
    assert "## eval/gold_reward (final)" in text
    assert "| arm-a | 0.5 [0.5, 0.5] |" in text and "| arm-b | 0.7 [0.7, 0.7] |" in text
    assert "1 seed(s) do not separate arm-a and arm-b; one seed gives no spread to judge from" in text
