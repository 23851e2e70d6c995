"""Sweeps and experiments end to end through a real local stack (Prefect server, MLflow server, the served deployments:
what `rlhf up` starts; the one test_deployments.py's runs use, tests/flows/conftest.py), driven with `prefect
deployment run sweep/default` as a user does where that is the check (bad input, an experiment), else created through
the API as the UI's Run button does; the trials are runs of reinforce/default on the tiny default, kept short
(2-6 iterations, a 16-prompt held-out eval)."""

import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import optuna
import psutil
import pytest
from mlflow.tracking import MlflowClient
from rliable import library as rly
from rliable import metrics as rm

from components.cli.main import main
from components.launch import stack
from components.launch.flow_runs import flow_run_name
from components.launch.processes import can_bind
from tests.flows.conftest import created_run
from tests.flows.conftest import stack_processes as every_stack_process

pytestmark = pytest.mark.slow(15)
BIN = Path(sys.executable).parent
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
EVAL = {"prompts": "builtin:sentiment", "every": 2, "max_prompts": 16}
CONFIG = {"preset": "tiny", "algorithm": "rloo", "iterations": 2, "eval": EVAL}
# trials with no reward server: quicker, where the test is not about it
IN_PROCESS = {"reward": {"launch": "in_process"}}


@pytest.fixture(scope="module")
def sweep_stack(flows_stack):
    """The package's local stack (tests/flows/conftest.py; test_deployments.py's runs are on it too), with an MLflow
    client and the sweeps' Optuna storage."""
    return {**flows_stack, "mlflow": MlflowClient(flows_stack["urls"]["mlflow"]),
            "storage": f"sqlite:///{flows_stack['state_dir'] / 'sweeps' / 'optuna.db'}"}


def start_sweep(s, sweep: dict, config: dict = CONFIG, deploy: dict | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
    """`prefect deployment run sweep/default` with the base run config, the sweep, and (`deploy`) what its trials are
    told of where they run."""
    params = ["--param", f"config={json.dumps(config)}", "--param", f"sweep={json.dumps({'poll_s': 1, **sweep})}"]
    params += ["--param", f"deploy={json.dumps(deploy)}"] if deploy else []
    return subprocess.run([str(BIN / "prefect"), "deployment", "run", "sweep/default", *params],
                          env=s["env"], capture_output=True, text=True, timeout=120, check=check)


def sweep_run(s, sweep: dict, config: dict = CONFIG, deploy: dict | None = None) -> str:
    """The id of a new flow run of sweep/default (what `start_sweep` sends), created through the API."""
    return created_run(s, "sweep/default", {"config": config, "sweep": {"poll_s": 1, **sweep},
                                            **({"deploy": deploy} if deploy else {})})


def flow_run_id(proc: subprocess.CompletedProcess) -> str:
    return re.search(r"UUID: ([0-9a-f-]{36})", proc.stdout).group(1)


def flow_run(s, run_id: str) -> dict:
    return stack.prefect_get(s['api'], f"/flow_runs/{run_id}").json()


def wait_until(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise TimeoutError(what)


def wait_final(s, run_id: str, timeout: float = 600) -> dict:
    return wait_until(lambda: (r := flow_run(s, run_id))["state"]["type"] in FINAL and r, timeout,
                      f"flow run {run_id} final")


def trial_runs(s, name: str) -> list[dict]:
    """The trials' flow runs of sweep `name` (tagged sweep-<name>), by name."""
    body = {"flow_runs": {"tags": {"all_": [f"sweep-{name}"]}}, "limit": 50}
    return sorted(stack.prefect_post(s['api'], "/flow_runs/filter", body, timeout=10).json(), key=lambda r: r["name"])


def flow_runs_of(s, flow: str) -> list[dict]:
    body = {"flows": {"name": {"any_": [flow]}}, "limit": 200}
    return stack.prefect_post(s['api'], "/flow_runs/filter", body, timeout=10).json()


def study(s, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=s["storage"])


def stack_processes(state_dir: Path, flow_run: str | None = None) -> list[psutil.Process]:
    """Live processes of this module's stack (their environment names its state directory; other pytest workers'
    never count); with `flow_run`, those of that flow run: its process (a fork of the deployments' forkserver, named
    after the run) and everything it started (they inherit PREFECT__FLOW_RUN_ID): its reward server, its actor ranks,
    its rollout server."""
    found = []
    for p in psutil.process_iter(["status", "name"]):
        try:
            env = p.environ()
            if (p.info["status"] != psutil.STATUS_ZOMBIE and env.get("RLHF_STATE_DIR") == str(state_dir)
                    and (flow_run is None or env.get("PREFECT__FLOW_RUN_ID") == flow_run
                         or p.info["name"] == flow_run_name(flow_run))):
                found.append(p)
        except psutil.Error:
            continue
    return found


def parent_and_trials(s, name: str):
    client = s["mlflow"]
    experiment = client.get_experiment_by_name("rlhf-flows").experiment_id
    parents = client.search_runs([experiment], f"tags.kind = 'sweep' and tags.sweep = '{name}'")
    assert len(parents) == 1, f"expected one parent run for sweep {name}, got {len(parents)}"
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    return parents[0], sorted(children, key=lambda r: r.info.run_name)


def table(s, run_id: str, tmp_path: Path) -> list[dict]:
    data = json.loads(Path(s["mlflow"].download_artifacts(run_id, "trials.json", str(tmp_path))).read_text())
    return [dict(zip(data["columns"], row)) for row in data["data"]]


def sweep_events(s, run_id: str) -> list[tuple[str, int]]:
    """What the sweep's flow run logged of its trials, in order: ("started" | "complete" | ..., trial number)."""
    logs = stack.prefect_post(s["api"], "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}},
                                                         "sort": "TIMESTAMP_ASC", "limit": 200}, timeout=10).json()
    said = (re.match(r"trial (\d+) (started|complete|fail|pruned)\b", log["message"]) for log in logs)
    return [(m.group(2), int(m.group(1))) for m in said if m]


def most_at_once(runs: list[dict]) -> int:
    """The most flow runs that were running at the same moment, from their Prefect start and end times."""
    events = sorted([(datetime.fromisoformat(r["start_time"]), 1) for r in runs]
                    + [(datetime.fromisoformat(r["end_time"]), -1) for r in runs])
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    return most


def test_every_algorithm_has_its_training_deployment():
    """The sweep names the training deployments without importing them (its flow run loads no model code); the
    reinforce flow runs every critic-free recipe, and refuses the one with a critic naming ppo/default."""
    from components.tasks import flow_config
    from flows.ppo import ppo
    from flows.reinforce import reinforce
    from flows.sweep import TRAINING_DEPLOYMENTS
    from models.algorithms import ALGORITHMS

    assert set(TRAINING_DEPLOYMENTS) == set(ALGORITHMS)
    assert TRAINING_DEPLOYMENTS["ppo"] == f"{ppo.name}/default"  # the recipe with a critic; every other:
    assert {TRAINING_DEPLOYMENTS[name] for name in ALGORITHMS if name != "ppo"} == {f"{reinforce.name}/default"}
    assert set(TRAINING_DEPLOYMENTS.values()) <= set(stack.DEPLOYMENTS)
    assert flow_config({"algorithm": "dapo"}, {}, "rloo").algorithm == "dapo"  # outside a deployment: as called
    with pytest.raises(ValueError, match="run ppo/default"):
        flow_config({"algorithm": "ppo"}, {}, "rloo")


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_input_is_refused_before_any_trial_starts(sweep_stack):
    """What the deployment's parameter schema can say is refused before a flow run exists; the rest fails the sweep's
    flow run at once, naming the field, before any trial (no reinforce flow run, no study)."""
    s = sweep_stack
    before = len(flow_runs_of(s, "sweep"))
    proc = start_sweep(s, {"name": "Bad_Name", "space": {"kl.beta": [0.1]}}, check=False)
    assert proc.returncode != 0 and "name" in proc.stdout + proc.stderr
    proc = start_sweep(s, {"name": "bad", "space": {"kl.beta": [0.1]}, "sampler": "bayes"}, check=False)
    assert proc.returncode != 0 and "sampler" in proc.stdout + proc.stderr
    assert len(flow_runs_of(s, "sweep")) == before

    cases = {  # name: (sweep, config, what the failed state says); every message: tests/components/sweep
        "unknown-field": ({"space": {"reinforce.optim.lrr": [1e-3]}}, CONFIG,
                          "'reinforce.optim.lrr' is not a config field: reinforce.optim has no field 'lrr'"),
        "no-eval": ({"space": {"kl.beta": [0.1]}}, {**CONFIG, "eval": {**EVAL, "every": 0}},
                    "sweep.metric: 'eval/reward' is logged by the held-out eval, which this config does not run"),
    }
    runs = {name: flow_run_id(start_sweep(s, {"name": name, **sweep}, config))
            for name, (sweep, config, _) in cases.items()}
    for name, run_id in runs.items():
        state = wait_final(s, run_id, timeout=180)["state"]
        assert state["type"] == "FAILED" and cases[name][2] in state["message"], (name, state)
    assert not [name for name in cases if trial_runs(s, name)]  # no trial ever started
    names = optuna.get_all_study_names(s["storage"]) if (s["state_dir"] / "sweeps" / "optuna.db").exists() else []
    assert not set(names) & set(cases)


# ------------------------------------------------------------------------------------------------ a 3-point grid
GRID = {"name": "grid", "space": {"reinforce.optim.lr": [1e-8, 1e-6, 1e-3]}, "concurrency": 2}
LRS = GRID["space"]["reinforce.optim.lr"]


def test_a_grid_sweep_runs_two_trials_at_a_time_as_nested_runs_with_table_best_trial_and_plots(sweep_stack, tmp_path):
    """Three trials at concurrency 2: the third waits for a slot (what "at most two at a time" needs to show)."""
    s = sweep_stack
    # the sweep's mechanics: no reward server
    sweep = wait_final(s, sweep_run(s, GRID, CONFIG, IN_PROCESS))
    assert sweep["state"]["type"] == "COMPLETED", sweep["state"]
    assert sweep["name"] == "grid"

    # Prefect: three trials named after the sweep, children of its flow run, never more than two at once
    runs = trial_runs(s, "grid")
    assert [r["name"] for r in runs] == ["grid-t0", "grid-t1", "grid-t2"]
    assert all(r["state"]["type"] == "COMPLETED" for r in runs), [r["state"] for r in runs]
    parents = {stack.prefect_get(s['api'], f"/task_runs/{r['parent_task_run_id']}").json()["flow_run_id"] for r in runs}
    assert parents == {sweep["id"]}
    # the sweep submits two at once and the third only once it has seen one end: the order of its own log lines (one
    # process: how fast a trial runs cannot reorder them; whether the two then overlap on the deployment's runner
    # depends on how fast a trial is, so that is not asserted)
    events = sweep_events(s, sweep["id"])
    assert events[:2] == [("started", 0), ("started", 1)], events
    assert "complete" in [what for what, _ in events[2:events.index(("started", 2))]], events
    created, ended = ([datetime.fromisoformat(r[key]) for r in runs] for key in ("created", "end_time"))
    assert created[2] >= min(ended[:2])  # Prefect's own record agrees: the third flow run exists after one ended
    assert most_at_once(runs) <= 2

    # MLflow: the parent run, three nested runs with the swept values as params, in the grid's order
    parent, children = parent_and_trials(s, "grid")
    assert [c.info.run_name for c in children] == ["grid-t0", "grid-t1", "grid-t2"]
    assert [float(c.data.params["reinforce.optim.lr"]) for c in children] == LRS
    assert all(c.data.tags["sweep.state"] == "complete" and c.info.status == "FINISHED" for c in children)
    assert [c.data.tags["prefect.flow_run_id"] for c in children] == [r["id"] for r in runs]

    # the table, the best trial, the plots, the comparison
    rows = table(s, parent.info.run_id, tmp_path)
    assert [(r["trial"], r["state"], r["mlflow_run_id"]) for r in rows] == [
        (i, "complete", c.info.run_id) for i, c in enumerate(children)]
    for row, child in zip(rows, children):  # a trial's value: the metric at its last step (the eval at iteration 2)
        last = max(s["mlflow"].get_metric_history(child.info.run_id, "eval/reward"), key=lambda m: m.step)
        assert last.step == 2 and row["value"] == pytest.approx(last.value, rel=1e-6)
    best = rows[int(parent.data.tags["best.trial"])]  # (two trials may tie)
    assert best["value"] == max(r["value"] for r in rows) > min(r["value"] for r in rows)
    # 1e-8 learns nothing
    assert best["reinforce.optim.lr"] == float(parent.data.tags["best.reinforce.optim.lr"]) == 1e-3
    assert parent.data.metrics["sweep/best_value"] == pytest.approx(best["value"])
    plots = {a.path for a in s["mlflow"].list_artifacts(parent.info.run_id, "plots")}
    assert {"plots/optimization_history.png", "plots/parallel_coordinate.png", "plots/param_importances.png"} <= plots
    png = Path(s["mlflow"].download_artifacts(parent.info.run_id, "plots/param_importances.png", str(tmp_path)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    artifact = stack.prefect_post(s['api'], "/artifacts/latest/filter",
                                  {"artifacts": {"key": {"any_": ["sweep-grid"]}}},
                          timeout=10).json()
    assert artifact[0]["type"] == "table" and len(json.loads(artifact[0]["data"])) == 3, artifact

    # `rlhf compare --sweep grid`: every trial's curves side by side
    assert main(["compare", "--sweep", "grid", "--tracking-uri", s["urls"]["mlflow"], "--out",
                 str(tmp_path / "compare")]) == 0
    markdown = (tmp_path / "compare" / "sweep-grid" / "comparison.md").read_text()
    for child, lr in zip(children, LRS):
        assert f"| {child.info.run_name}: reinforce.optim.lr={lr}, complete | {child.info.run_id} |" in markdown
    assert all(not stack_processes(s["state_dir"], r["id"]) for r in runs)


# ---------------------------------------------------------------------------------------------------- failures
def test_failed_trials_are_recorded_with_their_reason_and_a_sweep_whose_trials_all_fail_fails(sweep_stack, tmp_path):
    """A sweep of one trial, which fails: the trial is recorded with its reason (Optuna, Prefect, the table) and the
    sweep, every trial of it failed, fails."""
    s = sweep_stack
    sweep = {"name": "fail", "space": {"model.policy": ["/no/such/policy"]}}
    run = wait_final(s, sweep_run(s, sweep, CONFIG, IN_PROCESS))
    assert run["state"]["type"] == "FAILED", run["state"]
    assert "every trial of sweep fail failed" in run["state"]["message"], run["state"]
    trials = study(s, "fail").trials
    assert [t.state.name for t in trials] == ["FAIL"]
    assert "model.policy: model path '/no/such/policy' does not exist" in trials[0].user_attrs["reason"]
    assert [r["state"]["type"] for r in trial_runs(s, "fail")] == ["FAILED"]
    parent, _ = parent_and_trials(s, "fail")
    assert [r["state"] for r in table(s, parent.info.run_id, tmp_path)] == ["failed"]


# ------------------------------------------------------------------------------------------------ pruning
def test_a_trial_that_cannot_learn_is_pruned_at_an_eval_step_cancelled_and_leaves_nothing_running(sweep_stack):
    """lr 1e-3 completes first (concurrency 1); lr 1e-8 learns nothing: at the eval of step 2 its best is below the
    median of the completed trial's at that step, so it is pruned, and its flow run (with its reward server) is
    cancelled long before its 6th iteration."""
    s = sweep_stack
    sweep = {"name": "prune", "space": {"reinforce.optim.lr": [1e-3, 1e-8]}, "pruner": "median"}
    run = wait_final(s, sweep_run(s, sweep, {**CONFIG, "iterations": 6}))
    assert run["state"]["type"] == "COMPLETED", run["state"]
    good, bad = trial_runs(s, "prune")
    assert good["state"]["type"] == "COMPLETED" and bad["state"]["type"] == "CANCELLED", (good["state"], bad["state"])
    assert [t.state.name for t in study(s, "prune").trials] == ["COMPLETE", "PRUNED"]
    assert study(s, "prune").trials[1].user_attrs["reason"].startswith("pruned at step 2: its best eval/reward so far")
    _, (good_run, bad_run) = parent_and_trials(s, "prune")
    assert bad_run.data.tags["sweep.state"] == "pruned" and bad_run.info.status == "KILLED"
    steps = sorted(m.step for m in s["mlflow"].get_metric_history(bad_run.info.run_id, "eval/reward"))
    assert steps[:2] == [0, 2] and steps[-1] < 6, steps
    assert not stack_processes(s["state_dir"], bad["id"])  # no flow-run process, reward server or rank of it


# ------------------------------------------------------------------------------------------------ kill, rerun
RESUME = {"name": "resume", "space": {"reinforce.optim.lr": [1e-3, 3e-4]}}


def test_a_killed_sweep_resumes_and_runs_no_trial_twice_and_another_space_is_refused(sweep_stack, tmp_path):
    """The sweep's flow run is killed while its second trial runs; `rlhf sweep` with the same config and sweep (the
    flow in a shell, the trials on the deployments) resumes it: no trial is run again. The finished sweep, run again
    on the deployment, starts no trial; another space under its name is refused."""
    s = sweep_stack
    first = sweep_run(s, RESUME, CONFIG, IN_PROCESS)
    wait_until(lambda: [r["name"] for r in trial_runs(s, "resume")] == ["resume-t0", "resume-t1"], 600,
               "trial 1 started")
    assert trial_runs(s, "resume")[0]["state"]["type"] == "COMPLETED"
    for process in wait_until(lambda: stack_processes(s["state_dir"], first), 30, "the sweep's process"):
        process.kill()  # the sweep dies without a word; its trial 1 goes on
    assert wait_final(s, first, timeout=60)["state"]["type"] == "CRASHED"
    assert [t.state.name for t in study(s, "resume").trials] == ["COMPLETE", "RUNNING"]

    config = [f"--set={key}={value}" for key, value in (("preset", "tiny"), ("algorithm", "rloo"), ("iterations", 2),
                                                        ("deploy.reward.launch", "in_process"),
              *((f"eval.{k}", v) for k, v in EVAL.items()))]
    proc = subprocess.run([str(BIN / "rlhf"), "sweep", *config, "--name", "resume", "--space",
                           "reinforce.optim.lr=[1e-3, 3e-4]",
                           "--poll-s", "1"], env=s["env"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trial 1 (resume-t1) was left running by an earlier run of the sweep" in proc.stdout + proc.stderr
    runs = trial_runs(s, "resume")
    assert [r["name"] for r in runs] == ["resume-t0", "resume-t1"]  # nothing run again
    assert all(r["state"]["type"] == "COMPLETED" for r in runs)
    assert [t.state.name for t in study(s, "resume").trials] == ["COMPLETE", "COMPLETE"]
    _, children = parent_and_trials(s, "resume")
    assert [c.data.tags["sweep.state"] for c in children] == ["complete", "complete"]

    # the finished sweep, run again: no trial; under its name with another space: refused
    rerun = sweep_run(s, RESUME, CONFIG, IN_PROCESS)
    other = sweep_run(s, {**RESUME, "space": {"kl.beta": [0.01, 0.1]}}, CONFIG, IN_PROCESS)
    rerun = wait_final(s, rerun, timeout=300)
    assert rerun["state"]["type"] == "COMPLETED", rerun["state"]
    assert len(trial_runs(s, "resume")) == 2  # no new trial
    parent, children = parent_and_trials(s, "resume")  # the same parent run, its table not doubled
    assert len(children) == 2 and len(table(s, parent.info.run_id, tmp_path)) == 2
    assert [t.state.name for t in study(s, "resume").trials] == ["COMPLETE"] * 2

    other = wait_final(s, other, timeout=300)
    assert other["state"]["type"] == "FAILED"
    message = other["state"]["message"]
    assert "sweep.name: the study 'resume'" in message and "another space" in message
    assert len(trial_runs(s, "resume")) == 2


# ------------------------------------------------------------------------------------------------ an experiment
EXPERIMENT = {"name": "exp", "base": CONFIG, "arms": {"rloo": {}, "grpo": {"algorithm": "grpo"}}, "seeds": 3,
              "concurrency": 2, "reps": 500, "bootstrap_seed": 3, "poll_s": 1}


def test_a_killed_experiment_resumes_its_report_is_rliables_on_mlflow_and_a_rerun_starts_no_run(sweep_stack, tmp_path):
    """`prefect deployment run experiment/default`, killed once a run has ended; `rlhf experiment --config` resumes
    it (nothing finished is run again); its summary's statistics are what rliable computes from the runs' MLflow
    metrics with the same bootstrap seed; the report is on the parent run and rebuilt by `rlhf experiment report`;
    the experiment run again on the deployment starts no run."""
    s = sweep_stack
    params = ["--param", f"experiment={json.dumps(EXPERIMENT)}", "--param", f"deploy={json.dumps(IN_PROCESS)}"]

    def start():
        return subprocess.run([str(BIN / "prefect"), "deployment", "run", "experiment/default", *params],
                              env=s["env"], capture_output=True, text=True, timeout=120, check=True)

    first = flow_run_id(start())
    wait_until(lambda: len(trial_runs(s, "exp")) >= 3, 600, "a third run started (one has ended)")
    for process in wait_until(lambda: stack_processes(s["state_dir"], first), 30, "the experiment's process"):
        process.kill()
    assert wait_final(s, first, timeout=60)["state"]["type"] == "CRASHED"
    finished = {r["name"] for r in trial_runs(s, "exp") if r["state"]["type"] == "COMPLETED"}
    assert finished

    path = tmp_path / "experiment.yaml"
    path.write_text(json.dumps(EXPERIMENT))  # JSON is YAML
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run([str(BIN / "rlhf"), "experiment", "--config", str(path), "--set",
                           "deploy.reward.launch=in_process",
                           "--summary-out", str(summary_path)], env=s["env"], capture_output=True, text=True,
                           timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = trial_runs(s, "exp")
    # six flow runs, one per arm x seed, nothing run again: a trial whose flow run the killed run had created is
    # followed, even where the kill came before its id was recorded (components/sweep/trials.Trials.follow finds it
    # by name); one it had asked for but not started is run by the resume under the next trial number (the names
    # need not be t0..t5)
    assert len(runs) == 6 and len({r["name"] for r in runs}) == 6, [r["name"] for r in runs]
    assert all(r["state"]["type"] == "COMPLETED" for r in runs), [r["state"] for r in runs]
    assert finished <= {r["name"] for r in runs}  # what had finished before the kill was kept, not run again

    summary = json.loads(summary_path.read_text())
    assert summary["seeds"] == [0, 1, 2] and summary["arms"] == ["rloo", "grpo"]
    assert sorted((r["arm"], r["seed"]) for r in summary["runs"]) == sorted(
        (arm, seed) for arm in ("rloo", "grpo") for seed in range(3))
    client = s["mlflow"]
    final = {}
    for r in summary["runs"]:  # what rliable computes from the runs' MLflow metrics
        run = client.get_run(r["mlflow_run_id"])
        assert (run.data.params["seed"], run.data.params["algorithm"]) == (str(r["seed"]), r["arm"])
        history = max(client.get_metric_history(r["mlflow_run_id"], "eval/gold_reward"), key=lambda m: m.step)
        assert history.step == 2 and r["final"]["eval/gold_reward"] == history.value
        final.setdefault(r["arm"], {})[r["seed"]] = history.value
    scores = {arm: np.array([final[arm][seed] for seed in range(3)]).reshape(-1, 1) for arm in ("rloo", "grpo")}
    np.random.seed(3)
    point, bounds = rly.get_interval_estimates(scores, lambda x: np.array([rm.aggregate_iqm(x)]), reps=500)
    stats = summary["statistics"]["eval/gold_reward"]["final"]
    for arm in scores:
        iqm = stats["aggregates"][arm]["iqm"]
        assert iqm["value"] == pytest.approx(point[arm][0], rel=1e-12)
        assert [iqm["low"], iqm["high"]] == pytest.approx(bounds[arm][:, 0].tolist(), rel=1e-12)
    np.random.seed(3)
    poi, poi_bounds = rly.get_interval_estimates({"rloo,grpo": (scores["rloo"], scores["grpo"]),
                                                  "grpo,rloo": (scores["grpo"], scores["rloo"])},
                                                 rm.probability_of_improvement, reps=500)
    assert stats["improvement"]["rloo,grpo"]["probability"]["value"] == pytest.approx(poi["rloo,grpo"], rel=1e-12)
    assert stats["improvement"]["rloo,grpo"]["probability"]["low"] == pytest.approx(poi_bounds["rloo,grpo"][0, 0])

    parent = summary["mlflow_run_id"]
    assert {"report/report.html", "report/experiment.json"} <= {a.path for a in client.list_artifacts(parent, "report")}
    artifact = stack.prefect_post(s["api"], "/artifacts/latest/filter",
                                  {"artifacts": {"key": {"any_": ["experiment-exp"]}}},
                                  timeout=10).json()
    assert artifact[0]["type"] == "markdown" and "## eval/gold_reward (final)" in artifact[0]["data"]
    report = tmp_path / "report.html"
    assert main(["experiment", "report", "exp", "--tracking-uri", s["urls"]["mlflow"], "--out", str(report)]) == 0
    assert "<table>" in report.read_text() and f"/runs/{summary['runs'][0]['mlflow_run_id']}" in report.read_text()

    rerun = wait_final(s, flow_run_id(start()), timeout=300)
    assert rerun["state"]["type"] == "COMPLETED", rerun["state"]
    assert len(trial_runs(s, "exp")) == 6  # no run started
    assert all(not stack_processes(s["state_dir"], r["id"]) for r in runs)


def test_down_stops_everything_and_frees_ports(sweep_stack):
    """Runs last in tests/flows/ (after test_deployments.py and this module's runs): `down` stops exactly what `up`
    started, the ports can be bound again, and nothing of the stack or of its runs is left."""
    s = sweep_stack
    state = stack.stack_dir(s["state_dir"])
    pids = [int((state / f"{n}.pid").read_text()) for n in stack.SERVICES]
    stopped = stack.down(s["state_dir"], log=lambda *_: None)
    assert sorted(stopped) == sorted(stack.SERVICES)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    listening = {c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    for port in s["ports"]:
        assert port not in listening and can_bind("127.0.0.1", port), f"port {port} still bound"
    assert stack.down(s["state_dir"], log=lambda *_: None) == []
    # a run's server follows its killed parent within its stop's grace
    wait_until(lambda: not every_stack_process(s["state_dir"]), 30, "no process of the stack or of its runs left")
