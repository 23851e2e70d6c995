"""The pure parts of an experiment, without servers: its file checked against the run config (every refusal names the
field, before any run starts), the grid it runs as (paired seeds, each arm's partial config), the statistics against
float64 reference code and against rliable called as its own docs call it, and the report built from a real MLflow
SQLite store holding runs as the experiment's trials leave them (tags sweep.param.arm/seed, eval curves)."""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from pydantic import ValidationError
from rliable import library as rly
from rliable import metrics as rm

from components.cli.main import main
from components.sweep import statistics
from components.sweep.config import SweepConfig
from components.sweep.experiment import ExperimentConfig, check_experiment
from components.sweep.report import build, find_experiment, log_report, readings
from components.sweep.space import SweepError, check_sweep, trial_config

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`

BASE = {"preset": "tiny", "algorithm": "rloo", "iterations": 4, "eval": {"prompts": "builtin:sentiment", "every": 2}}


def experiment(**fields) -> ExperimentConfig:
    return ExperimentConfig(**{"name": "exp", "base": BASE, "arms": {"rloo": {}, "grpo": {"algorithm": "grpo"}},
                               **fields})


# ------------------------------------------------------------------------------------------------ the file
@pytest.mark.parametrize("arms, metrics, expected", [
    ({"a": {"seed": 3}, "b": {}}, None, "arms.a: sets 'seed', and the seeds are paired"),
    ({"a": {}, "b": {"algorithm": "rloo"}}, None, "arms: a and b make the same config"),
    ({"a": {"kl.beta": 0.1}, "b": {"kl": {"beta": 0.1}}}, None, "arms: a and b make the same config"),
    ({"a": {"kl.beta": -1.0}}, None, "arms.a: kl.beta: Input should be greater than or equal to 0"),
    ({"a": {"no_such_field": 1}}, None, "arms.a: no_such_field: Extra inputs are not permitted"),
    ({"a": {"run_name": "x"}}, None, "arms.a: sets 'run_name', which the sweep sets"),
    ({"a": {}}, ["eval/rewrad"],
     "experiment.metrics: 'eval/rewrad' is not a metric an RL run logs (did you mean 'eval/reward'"),
    ({"a": {}, "ppo": {"algorithm": "ppo"}}, ["val/explained_variance"],
     "experiment.metrics: 'val/explained_variance' comes from a critic, and rloo has none (arm a)"),
])
def test_bad_experiments_are_refused_naming_the_field(arms, metrics, expected):
    e = experiment(arms=arms, metrics=metrics)
    with pytest.raises(SweepError) as raised:
        check_experiment(e.base_config(), e)
    assert str(raised.value).startswith(expected), str(raised.value)


@pytest.mark.parametrize("fields, expected", [
    ({"arms": {}}, "arms\n  Value error, is empty"),
    ({"seeds": [1, 1]}, "seeds\n  Value error, needs distinct seeds"),
    ({"seeds": 0}, "Input should be greater than 0"),
    ({"metrics": ["eval/reward", "eval/reward"]}, "needs distinct metric names"),
    ({"name": "Bad Name"}, "String should match pattern"),
    ({"arms": {"Bad Arm": {}}}, "arms: the name 'Bad Arm' needs lowercase letters"),
])
def test_a_malformed_file_is_refused(fields, expected):
    with pytest.raises(ValidationError, match=expected.split("\n")[-1].strip()):
        experiment(**fields).as_sweep(experiment().base_config())


def test_an_arm_field_in_a_sweep_needs_its_arms():
    with pytest.raises(ValidationError, match="picks one of `arms`"):
        SweepConfig(name="s", space={"arm": ["a"]})
    with pytest.raises(ValidationError, match="are not arms"):
        SweepConfig(name="s", space={"arm": ["a", "b"]}, arms={"a": {}})
    with pytest.raises(ValidationError, match="no 'arm' field"):
        SweepConfig(name="s", space={"seed": [0]}, arms={"a": {}})


def test_the_grid_runs_paired_seeds_seed_by_seed_each_arm_its_own_config_and_deployment():
    e = experiment(seeds=[7, 8, 9], arms={"rloo": {}, "ppo": {"algorithm": "ppo", "kl": {"beta": 0.02}}})
    config = e.base_config()
    sweep = check_experiment(config, e)
    space = check_sweep(config, sweep)
    assert space.grid == [{"seed": s, "arm": a} for s, a in itertools.product([7, 8, 9], ["rloo", "ppo"])]
    assert space.algorithms == ("rloo", "ppo")  # trials of each go to its own deployment
    assert e.metric_names(config) == ["eval/gold_reward"]  # the shipped task has a gold reward
    trial = trial_config(config, sweep, 3, {"seed": 8, "arm": "ppo"}, "parent")
    assert (trial.algorithm, trial.seed, trial.kl.beta, trial.iterations, trial.run_name) == ("ppo", 8, 0.02, 4,
                                                                                              "exp-t3")
    assert trial.tracking.parent_run_id == "parent"
    assert trial_config(config, sweep, 0, {"seed": 7, "arm": "rloo"}, "parent").algorithm == "rloo"


# ------------------------------------------------------------------------------------------------ statistics
def iqm64(x: np.ndarray) -> float:
    """The interquartile mean by its definition: the mean of the middle half (n divisible by 4)."""
    s = np.sort(np.asarray(x, dtype=np.float64))
    n = len(s)
    return float(s[n // 4: n - n // 4].mean())


def poi64(x: np.ndarray, y: np.ndarray) -> float:
    """P(X > Y) + P(X = Y)/2 over every pair of runs."""
    return float(np.mean([(a > b) + 0.5 * (a == b) for a in x for b in y]))


def test_run_scores_match_the_float64_area_under_the_curve():
    history = [(0, 0.1), (2, 0.5), (3, 0.4), (6, 0.9)]
    area = (0.1 + 0.5) / 2 * 2 + (0.5 + 0.4) / 2 * 1 + (0.4 + 0.9) / 2 * 3
    assert statistics.run_scores(history) == pytest.approx({"final": 0.9, "auc": area / 6}, rel=1e-12)
    assert statistics.run_scores([(4, 0.3)]) == {"final": 0.3, "auc": 0.3}


def test_aggregates_and_improvement_are_rliables_and_their_points_the_definitions():
    rng = np.random.default_rng(3)
    scores = {"a": rng.normal(0.4, 0.1, 8), "b": rng.normal(0.6, 0.1, 8), "c": rng.normal(0.41, 0.1, 8)}
    reps, confidence, seed = 500, 0.9, 11
    state = np.random.get_state()[1].copy()
    got = statistics.aggregates(scores, reps, confidence, seed)
    assert np.array_equal(np.random.get_state()[1], state)  # the global RNG is put back
    for arm, s in scores.items():
        assert got[arm]["iqm"]["value"] == pytest.approx(iqm64(s), rel=1e-12)
        assert got[arm]["mean"]["value"] == pytest.approx(float(np.mean(s)), rel=1e-12)
        assert got[arm]["median"]["value"] == pytest.approx(float(np.median(s)), rel=1e-12)
    # the intervals: rliable's, called as its docs call it, after seeding numpy's global RNG
    np.random.seed(seed)
    point, bounds = rly.get_interval_estimates(
        {k: v.reshape(-1, 1) for k, v in scores.items()},
        lambda x: np.array([rm.aggregate_iqm(x), rm.aggregate_mean(x), np.median(x)]), reps=reps,
        confidence_interval_size=confidence)
    for arm in scores:
        assert [got[arm][k]["low"] for k in ("iqm", "mean", "median")] == bounds[arm][0].tolist()
        assert [got[arm][k]["high"] for k in ("iqm", "mean", "median")] == bounds[arm][1].tolist()
        assert all(got[arm][k]["low"] <= got[arm][k]["value"] <= got[arm][k]["high"] for k in ("iqm", "mean", "median"))
    assert statistics.aggregates(scores, reps, confidence, seed) == got  # the same every time

    pairs = statistics.improvement(scores, reps, confidence, seed)
    assert list(pairs) == ["a,b", "a,c", "b,a", "b,c", "c,a", "c,b"]
    for key, pair in pairs.items():
        x, y = key.split(",")
        assert pair["probability"]["value"] == pytest.approx(poi64(scores[x], scores[y]), rel=1e-12)
        assert pair["differences"] == pytest.approx((scores[x] - scores[y]).tolist(), rel=1e-12)
        assert pair["mean_difference"]["value"] == pytest.approx(float(np.mean(scores[x] - scores[y])), rel=1e-12)
    np.random.seed(seed)
    _, poi_bounds = rly.get_interval_estimates(
        {f"{x},{y}": (scores[x].reshape(-1, 1), scores[y].reshape(-1, 1)) for x, y in statistics.pairs(list(scores))},
        rm.probability_of_improvement, reps=reps, confidence_interval_size=confidence)
    assert [pairs[k]["probability"]["low"] for k in pairs] == [poi_bounds[k][0, 0] for k in pairs]
    assert pairs["b,a"]["separated"] and pairs["b,a"]["mean_difference"]["low"] > 0
    minimize = statistics.improvement(scores, reps, confidence, seed, direction="minimize")
    assert minimize["a,b"]["probability"]["value"] == pytest.approx(poi64(-scores["a"], -scores["b"]), rel=1e-12)


def test_arms_that_do_not_separate_say_so_and_how_many_seeds_would():
    a = np.array([0.50, 0.40, 0.62, 0.47])
    b = a + np.array([0.05, -0.03, 0.06, 0.02])  # a small, noisy paired difference
    pair = statistics.improvement({"a": a, "b": b}, 1000, 0.95, 0)["b,a"]
    d = b - a
    assert pair["mean_difference"]["low"] <= 0 <= pair["mean_difference"]["high"] and not pair["separated"]
    z = 1.959963984540054
    assert pair["seeds_needed"] == math.ceil((z * d.std(ddof=1) / abs(d.mean())) ** 2)
    result = {"seeds": [0, 1, 2, 3], "confidence": 0.95, "arms": ["b", "a"], "statistics": {"eval/reward": {
        aggregate: {"improvement": {"b,a": pair, "a,b": pair}} for aggregate in ("final", "auc")}}}
    text = readings(result)[0]
    assert "the 95% interval includes 0: 4 seed(s) do not separate b and a" in text
    assert f"about {pair['seeds_needed']} paired seeds would separate them" in text
    assert statistics.seeds_needed(np.array([0.1]), 0.95) is None  # one seed: no spread to judge from


def test_profiles_and_curves_are_rliables():
    rng = np.random.default_rng(0)
    scores = {"a": rng.random(5), "b": rng.random(5) + 0.3}
    got = statistics.profiles(scores, 300, 0.95, 4)
    tau = np.array(got["tau"])
    assert tau[0] == min(map(min, scores.values())) and tau[-1] == max(map(max, scores.values()))
    for arm, s in scores.items():  # the point: the share of runs scoring above tau
        assert got["arms"][arm]["value"] == pytest.approx([(s > t).mean() for t in tau], abs=1e-12)
    curves = {"a": rng.random((5, 3)), "b": rng.random((5, 3))}
    got = statistics.curves(curves, [0, 2, 4], 300, 0.95, 4)
    for arm, v in curves.items():
        assert got["arms"][arm]["value"] == pytest.approx([rm.aggregate_iqm(v[:, j:j + 1]) for j in range(3)],
                                                          rel=1e-12)
        assert all(lo <= p <= hi for lo, p, hi in zip(got["arms"][arm]["low"], got["arms"][arm]["value"],
                                                       got["arms"][arm]["high"]))


# ------------------------------------------------------------------------------------------------ the report
def trial_run(client, experiment_id, parent, arm, seed, curve, name):
    """A run as an experiment's trial leaves it: nested, tagged with its arm and seed, its eval curve logged."""
    run = client.create_run(experiment_id, run_name=name, tags={"mlflow.parentRunId": parent, "sweep.state": "complete",
                                                                "sweep.param.arm": arm, "sweep.param.seed": str(seed),
                                                                "reproducible": "true",
                                                                "provenance.code.libraries.torch": "2.13.0"})
    now = int(time.time() * 1000)
    client.log_batch(run.info.run_id, metrics=[Metric("eval/gold_reward", v, now + i, step)
                                               for i, (step, v) in enumerate(curve)])
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def test_the_report_from_mlflow_is_rliables_on_the_runs_metrics(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("rlhf-flows", artifact_location=(tmp_path / "artifacts").as_uri())
    e = experiment(seeds=3, reps=400, bootstrap_seed=5)
    parent = client.create_run(experiment_id, run_name="exp", tags={"kind": "sweep", "sweep": "exp",
                                                                    "experiment": "exp"}).info.run_id
    rng = np.random.default_rng(1)
    curves = {(arm, seed): [(0, 0.2), (2, 0.2 + 0.1 * rng.random() + shift), (4, 0.3 + 0.2 * rng.random() + shift)]
              for seed in range(3) for arm, shift in (("rloo", 0.0), ("grpo", 0.3))}
    ids = {key: trial_run(client, experiment_id, parent, *key, curve, f"exp-t{i}")
           for i, (key, curve) in enumerate(curves.items())}
    del curves["grpo", 2]  # seed 2 of grpo did not complete: seed 2 is not compared (the scores stay paired)
    client.delete_run(ids.pop(("grpo", 2)))
    result, md, page, images = build(client, uri, experiment_id, parent, e, e.base_config())
    assert result["seeds"] == [0, 1] and result["unpaired_seeds"] == [2]
    assert {(r["arm"], r["seed"]): r["mlflow_run_id"] for r in result["runs"]} == ids
    final = {arm: np.array([curves[arm, s][-1][1] for s in (0, 1)]) for arm in ("rloo", "grpo")}
    np.random.seed(5)
    _, bounds = rly.get_interval_estimates({k: v.reshape(-1, 1) for k, v in final.items()},
                                           lambda x: np.array([rm.aggregate_iqm(x), rm.aggregate_mean(x),
                                                               np.median(x)]), reps=400)
    stats = result["statistics"]["eval/gold_reward"]["final"]
    for arm in final:
        assert stats["aggregates"][arm]["iqm"]["value"] == pytest.approx(iqm64(np.repeat(final[arm], 2)), rel=1e-12)
        assert [stats["aggregates"][arm]["iqm"]["low"],
                stats["aggregates"][arm]["iqm"]["high"]] == bounds[arm][:, 0].tolist()
    assert stats["improvement"]["grpo,rloo"]["probability"]["value"] == pytest.approx(poi64(final["grpo"],
                                                                                            final["rloo"]))
    auc = result["statistics"]["eval/gold_reward"]["auc"]["scores"]["rloo"]
    assert auc == pytest.approx([statistics.run_scores(curves["rloo", s])["auc"] for s in (0, 1)], rel=1e-12)
    assert result["statistics"]["eval/gold_reward"]["curve"]["steps"] == [0, 2, 4]
    assert result["config_diff"]["grpo"]["algorithm"] == ["rloo", "grpo"] and result["config_diff"]["rloo"] == {}
    assert result["provenance"]["tags"]["reproducible"] == "true"
    assert result["provenance"]["libraries"] == {"torch": "2.13.0"}
    assert set(images) == {"profile_eval_gold_reward.png", "curve_eval_gold_reward.png"}
    assert all(png[:8] == b"\x89PNG\r\n\x1a\n" for png in images.values())
    assert "| rloo |" in md and "grpo over rloo" in md and "`algorithm` rloo -> grpo" in md
    assert page.count("<table>") >= 5 and page.count("src='data:image/png;base64,") == 2
    assert "http" not in page.split("<body>")[1]

    log_report(client, parent, e, result, md, page, images)
    found_id, found_parent, found = find_experiment(client, "rlhf-flows", "exp", uri)
    assert (found_id, found_parent, found) == (experiment_id, parent, e)
    logged = {a.path for a in client.list_artifacts(parent, "report")}
    assert {"report/report.html", "report/report.md", "report/experiment.json",
            "report/curve_eval_gold_reward.png"} <= logged
    iqm = client.get_run(parent).data.metrics["experiment/eval/gold_reward/grpo/iqm"]
    assert iqm == pytest.approx(stats["aggregates"]["grpo"]["iqm"]["value"])

    # `rlhf experiment report NAME --out FILE`: the same report, rebuilt from MLflow
    out, summary = tmp_path / "report.html", tmp_path / "summary.json"
    assert main(["experiment", "report", "exp", "--tracking-uri", uri, "--out", str(out), "--summary-out",
                 str(summary)]) == 0
    rebuilt = json.loads(summary.read_text())
    assert rebuilt["statistics"] == json.loads(json.dumps(result["statistics"]))
    assert out.read_text().startswith("<!doctype html>")
    with pytest.raises(SystemExit, match="no experiment named 'other' in experiment 'rlhf-flows'"):
        main(["experiment", "report", "other", "--tracking-uri", uri])


def test_rlhf_experiment_refuses_a_bad_file_before_it_contacts_anything(tmp_path):
    path = Path(tmp_path / "e.yaml")
    path.write_text("name: e\nbase: {algorithm: rloo}\narms: {a: {seed: 1}, b: {}}\n")
    with pytest.raises(SystemExit, match="invalid experiment: arms.a: sets 'seed'"):
        main(["experiment", "--config", str(path)])
    path.write_text("name: e\nbase: {algorithm: rloo}\narms: {a: {}, b: {algorithm: grpo}}\nseeds: [1, 1]\n")
    with pytest.raises(SystemExit, match="invalid experiment: .*seeds"):
        main(["experiment", "--config", str(path)])
    with pytest.raises(SystemExit, match="invalid experiment: .*held-out eval"):
        main(["experiment", "--config", str(path), "--set", "seeds=2"])
