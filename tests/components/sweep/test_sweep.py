"""The pure parts of a sweep, without servers: the sweep section and its space checked against the run config (every
refusal names the field), the space as Optuna distributions, a trial's config, the study in a real SQLite storage
(what a rerun keeps, follows and runs again), the parent MLflow run in a real SQLite store, and `rlhf sweep` refusing
bad input before it contacts anything."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState
from pydantic import ValidationError

from components.cli.main import main
from components.sweep.config import SweepConfig
from components.sweep.space import SweepError, check_sweep, distribution, trial_config
from components.sweep.study import Plan, open_study, unfinished
from components.sweep.tracking import SweepRun, find_sweep, trial_runs
from models.config import RLHFConfig, merge

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`

EVAL = {"prompts": "builtin:sentiment", "every": 2}
GRID = {"reinforce.optim.lr": [1e-4, 3e-4], "kl.beta": [0.01, 0.1]}


def base(**overrides) -> RLHFConfig:
    return merge(RLHFConfig(algorithm="rloo", eval=EVAL), overrides)


def refused(space: dict, config: RLHFConfig | None = None, **sweep) -> str:
    with pytest.raises(SweepError) as err:
        check_sweep(config or base(), SweepConfig(name="s", space=space, **sweep))
    return str(err.value)


# ------------------------------------------------------------------------------------------------ the space
def test_a_grid_is_every_combination_in_the_lists_order_as_categorical_distributions():
    space = check_sweep(base(), SweepConfig(name="s", space=GRID))
    assert space.distributions == {"reinforce.optim.lr": CategoricalDistribution([1e-4, 3e-4]),
                                   "kl.beta": CategoricalDistribution([0.01, 0.1])}
    assert space.grid == [{"reinforce.optim.lr": 1e-4, "kl.beta": 0.01}, {"reinforce.optim.lr": 1e-4, "kl.beta": 0.1},
                          {"reinforce.optim.lr": 3e-4, "kl.beta": 0.01}, {"reinforce.optim.lr": 3e-4, "kl.beta": 0.1}]


def test_a_range_takes_the_type_of_its_field():
    space = check_sweep(base(), SweepConfig(name="s", sampler="tpe", space={
        "reinforce.optim.lr": {"low": 1e-5, "high": 1e-3, "log": True}, "iterations": {"low": 2, "high": 6},
        "kl.estimator": ["k1", "k3"]}))
    assert space.distributions == {"reinforce.optim.lr": FloatDistribution(1e-5, 1e-3, log=True),
                                   "iterations": IntDistribution(2, 6),
                                   "kl.estimator": CategoricalDistribution(["k1", "k3"])}
    assert space.grid is None
    assert distribution("eval.max_prompts", SweepConfig(name="s", sampler="random", space={
        # Optional[int]
        "eval.max_prompts": {"low": 8, "high": 32}}).space["eval.max_prompts"]) == IntDistribution(8, 32)


@pytest.mark.parametrize("space, sweep, expected", [
    ({"reinforce.optim.lrr": [1e-3]}, {},
     r"'reinforce\.optim\.lrr' is not a config field: reinforce\.optim has no field 'lrr' \(its fields: lr, "),
    ({"reinfurce.optim.lr": [1e-3]}, {},
     r"'reinfurce\.optim\.lr' is not a config field: the config has no field 'reinfurce'"),
    ({"reinforce.optim": [1]}, {}, r"'reinforce\.optim' is a section, not a field: name one of its fields \(lr, "),
    ({"iterations.every": [1]}, {}, r"'iterations\.every' is not a config field: iterations is a value, not a section"),
    ({"algorithm": ["ppo", "rloo"]}, {}, r"'algorithm' cannot be swept"),
    ({"run_name": ["a"]}, {}, r"'run_name' cannot be swept"),
    ({"reinforce.optim.lr": [1e-3, -1.0]}, {},
     r"the config refuses reinforce\.optim\.lr=-1\.0: reinforce\.optim\.lr: Input should be greater than 0"),
    ({"reinforce.num_rollouts_per_prompt": [1, 4]}, {},
     r"refuses reinforce\.num_rollouts_per_prompt=1: .*must be >= 2"),
    ({"kl.estimator": ["k1", "k9"]}, {},
     r"refuses kl\.estimator='k9': kl\.estimator: Input should be 'k1', 'abs', 'k2', 'k3' or 'k3\+'"),
    ({"kl.estimator": {"low": 0, "high": 1}}, {"sampler": "tpe"},
     r"sweep\.space\['kl\.estimator'\]: a range \{low, high\} needs a numeric field, and kl\.estimator is one of 'k1', "
     r"'abs'"),
    ({"iterations": {"low": 2, "high": 4.5}}, {"sampler": "random"},
     r"iterations is an int field, so the range needs whole numbers, got 4\.5"),
    ({"iterations": {"low": 0, "high": 4}}, {"sampler": "random"},
     r"the config refuses iterations=0: iterations: Input should be greater than 0"),
    ({"eval.every": [2, 0]}, {},
     r"sweep\.metric: 'eval/reward' is logged by the held-out eval, .* \(with eval\.every=0\)"),
    ({"kl.beta": [0.1]}, {"metric": "critic/step"},
     r"sweep\.metric: 'critic/step' comes from a critic, and rloo has none"),
])
def test_bad_spaces_are_refused_naming_the_field(space, sweep, expected):
    assert pytest.raises(SweepError, check_sweep, base(), SweepConfig(name="s", space=space, **sweep)).match(expected)


def test_a_combination_the_config_refuses_as_a_whole_is_named():
    """Each value alone is fine; together with the base config's 2 actor ranks, a batch of 1 prompt is not."""
    message = refused({"reinforce.rollout_batch_size": [4, 1]}, base(**{"deploy.actor.nproc_per_node": 2}))
    assert "refuses reinforce.rollout_batch_size=1" in message and "actor's world size 2" in message


def test_a_metric_the_config_cannot_produce_is_refused():
    assert "set eval.prompts and eval.every > 0 (eval.prompts=None, eval.every=0)" in refused(GRID,
                                                                                              RLHFConfig(algorithm="rloo"))
    no_gold = RLHFConfig(algorithm="rloo", reward={"gold": None}, data={"prompts": "prompts.txt"})
    assert "reward.gold is None" in refused(GRID, no_gold, metric="objective/gold_reward")
    builtin = base(reward={"gold": None}, data={"prompts": "builtin:sentiment"})  # the shipped task's own gold reward
    check_sweep(builtin, SweepConfig(name="s", space=GRID, metric="objective/gold_reward"))
    assert "comes from a critic, and rloo has none" in refused(GRID, base(), metric="loss/value_avg")
    assert "rollout.engine is 'native'" in refused(GRID, base(), metric="rollout/staleness_max")
    assert "logged once" in refused(GRID, base(), metric="data/rows")
    check_sweep(RLHFConfig(algorithm="rloo"), SweepConfig(name="s", space=GRID, metric="reward"))  # any step


def test_a_metric_no_run_logs_is_refused_before_any_trial_starts_naming_the_close_ones():
    """What the issue's new user tried: `metric: eval/score` (the name the docs once gave). Refused at once, with
    the names the code logs that come close (models/metrics.py, the list docs/metrics.md is generated from)."""
    message = refused(GRID, base(), metric="eval/score")
    assert "'eval/score' is not a metric an RL run logs (did you mean " in message
    assert "'eval/reward'" in message.split("did you mean", 1)[1].split(")")[0]
    assert "docs/metrics.md lists every metric the code logs" in message
    functions = base(reward={"source": "function", "function": "rewards.py:accuracy_reward"})
    check_sweep(functions, SweepConfig(name="s", space=GRID, metric="rewards/accuracy_reward/mean"))
    assert "needs reward functions" in refused(GRID, base(), metric="rewards/x/mean")
    # a pipeline's eval stage's, on the pipeline's run
    check_sweep(base(), SweepConfig(name="s", space=GRID, metric="eval/eval/win_rate"), pipeline=True)
    assert "is not a metric an RL run logs" in refused(GRID, base(), metric="eval/win_rate")


@pytest.mark.parametrize("sweep, field, expected", [
    ({"space": {}}, "space", "is empty: give at least one dotted config field"),
    ({"space": {"kl.beta": []}}, "space", "'kl.beta' has an empty list of values"),
    ({"space": {"kl.beta": [0.1, 0.1]}}, "space", "'kl.beta' lists a value twice"),
    ({"space": {"kl.beta": {"low": 0.1, "high": 0.2}}}, "",
     "sampler 'grid' needs a list of values; a range {low, high} needs sampler 'random' or 'tpe'"),
    ({"space": {"kl.beta": {"low": 0.2, "high": 0.1}}, "sampler": "tpe"}, "space.kl.beta.range",
     "needs finite low < high"),
    ({"space": {"kl.beta": {"low": 0.0, "high": 0.1, "log": True}}, "sampler": "tpe"}, "space.kl.beta.range",
     "log=true needs low > 0"),
    ({"space": {"kl.beta": [[0.1, 0.2]]}}, "space.kl.beta.values.0.float", "Input should be a valid number"),
    ({"space": GRID, "name": "Lr_KL"}, "name", "String should match pattern"),
    ({"space": GRID, "sampler": "bayes"}, "sampler", "Input should be 'grid', 'random' or 'tpe'"),
    ({"space": GRID, "concurrency": 0}, "concurrency", "greater than or equal to 1"),
])
def test_the_sweep_section_refuses_bad_input_naming_the_field(sweep, field, expected):
    with pytest.raises(ValidationError) as err:
        SweepConfig.model_validate({"name": "s", **sweep})
    assert field in [".".join(map(str, e["loc"])) for e in err.value.errors()] and expected in str(err.value)


def test_a_trial_config_has_the_values_its_name_and_its_parent_and_nothing_of_where_it_runs():
    """A trial is given what it trains only: where it runs (its servers' ports among it) is its deployment's, whose
    servers pick free ports of their own, so two trials starting together never race for one."""
    sweep = SweepConfig(name="lr-kl", space=GRID)
    cfg = trial_config(base(), sweep, 3, {"reinforce.optim.lr": 3e-4, "kl.beta": 0.1}, "p1")
    assert (cfg.run_name, cfg.tracking.parent_run_id, cfg.reinforce.optim.lr, cfg.kl.beta) == ("lr-kl-t3", "p1", 3e-4,
                                                                                               0.1)
    assert "deploy" not in cfg.run.model_dump() and cfg.run.run_name == "lr-kl-t3"
    assert (cfg.deploy.critic.port, cfg.deploy.reward.port, cfg.deploy.rollout.port,
            cfg.deploy.actor.master_port) == (None,) * 4
    with pytest.raises(SweepError, match="'deploy.critic.port' is not a config field"):
        check_sweep(base(), SweepConfig(name="ports", space={"deploy.critic.port": [9100, 9200]}))


# ------------------------------------------------------------------------------------------------ the study
def sweep_in(tmp_path: Path, **fields) -> tuple[RLHFConfig, SweepConfig]:
    return base(**{"deploy.state_dir": str(tmp_path)}), SweepConfig(name="lr-kl", space=GRID, **fields)


def run_plan(study, space, sweep, outcomes: list, followed=()) -> list[optuna.Trial]:
    """Start what the plan holds, and tell them `outcomes` (a state, or None: left running)."""
    plan, started = Plan(study, space, sweep, list(followed)), []
    for outcome in outcomes:
        assert plan
        trial = plan.ask()
        started.append(trial)
        if outcome is not None:
            study.tell(trial, 1.0 if outcome == TrialState.COMPLETE else None, state=outcome)
    assert not plan
    return started


def test_the_study_lives_in_sqlite_in_the_state_dir_and_a_rerun_keeps_finished_trials(tmp_path):
    config, sweep = sweep_in(tmp_path)
    space = check_sweep(config, sweep)
    study = open_study(config, sweep, space)
    first = run_plan(study, space, sweep, [TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, None])
    assert [t.params for t in first] == space.grid  # the lists' order
    assert (tmp_path / "sweeps" / "optuna.db").exists()

    again = open_study(config, sweep, space)  # what a rerun does: the RUNNING one is followed, the FAIL run again
    left = unfinished(again)
    assert [t.number for t in left] == [3]
    rerun = run_plan(again, space, sweep, [TrialState.COMPLETE], followed=left)
    assert [t.params for t in rerun] == [space.grid[2]] and rerun[0].number == 4
    assert Plan(again, space, sweep, unfinished(again)).left == 0  # the followed trial holds the last combination


def test_a_combination_enqueued_by_a_run_that_died_before_asking_for_it_is_failed_and_run_again(tmp_path):
    config, sweep = sweep_in(tmp_path)
    space = check_sweep(config, sweep)
    study = open_study(config, sweep, space)
    study.enqueue_trial(space.grid[0])  # the run died between enqueue_trial and ask
    again = open_study(config, sweep, space)
    assert [(t.state, t.user_attrs["reason"]) for t in again.trials] == [
        (TrialState.FAIL, "enqueued by a run of the sweep that stopped before starting it")]
    assert Plan(again, space, sweep, []).left == 4


def test_random_and_tpe_count_the_kept_trials_toward_sweep_trials(tmp_path):
    config = base(**{"deploy.state_dir": str(tmp_path)})
    sweep = SweepConfig(name="r", sampler="random", trials=3,
                        space={"reinforce.optim.lr": {"low": 1e-5, "high": 1e-3, "log": True}})
    space = check_sweep(config, sweep)
    study = open_study(config, sweep, space)
    trials = run_plan(study, space, sweep, [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE])
    assert all(1e-5 <= t.params["reinforce.optim.lr"] <= 1e-3 for t in trials)
    assert Plan(open_study(config, sweep, space), space, sweep, []).left == 1  # the failed one is run again


def test_a_study_of_the_same_name_with_another_definition_is_refused(tmp_path):
    config, sweep = sweep_in(tmp_path)
    open_study(config, sweep, check_sweep(config, sweep))
    other = sweep.model_copy(update={"space": {"kl.beta": [0.01, 0.1]}})
    with pytest.raises(SweepError, match=r"sweep\.name: the study 'lr-kl' in sqlite:///.*optuna\.db was started with "
                                         r"another space"):
        open_study(config, other, check_sweep(config, other))
    with pytest.raises(SweepError, match="another config"):
        open_study(base(**{"deploy.state_dir": str(tmp_path)}, iterations=3), sweep, check_sweep(config, sweep))
    open_study(config, sweep.model_copy(update={"concurrency": 4, "pruner": "median"}), check_sweep(config, sweep))


def test_the_storage_can_be_any_sqlalchemy_url(tmp_path, monkeypatch):
    config, sweep = sweep_in(tmp_path / "state", storage=f"sqlite:///{tmp_path / 'shared.db'}")
    open_study(config, sweep, check_sweep(config, sweep))
    assert (tmp_path / "shared.db").exists() and not (tmp_path / "state" / "sweeps").exists()
    monkeypatch.setenv("RLHF_SWEEP_STORAGE", f"sqlite:///{tmp_path / 'env.db'}")
    config, sweep = sweep_in(tmp_path / "state")
    open_study(config, sweep, check_sweep(config, sweep))
    assert (tmp_path / "env.db").exists()
    assert optuna.load_study(study_name="lr-kl",
                             storage=f"sqlite:///{tmp_path / 'env.db'}").direction.name == "MAXIMIZE"


# ------------------------------------------------------------------------------------------------ tracking
def test_the_parent_run_is_found_again_and_the_table_gets_each_finished_trial_once(tmp_path, mlflow_uri):
    config = base(**{"deploy.state_dir": str(tmp_path), "deploy.tracking.uri": mlflow_uri})
    sweep = SweepConfig(name="lr-kl", space=GRID)
    space = check_sweep(config, sweep)
    study = open_study(config, sweep, space)
    with SweepRun.open(config, sweep) as parent:
        client = MlflowClient(mlflow_uri)
        for number, (params, outcome) in enumerate(zip(space.grid, (0.5, 0.9, None, "fail"))):
            trial = trial_config(config, sweep, number, params, parent.run_id)
            run = client.create_run(parent.experiment_id, run_name=trial.run_name,
                                    tags={"mlflow.parentRunId": parent.run_id})
            for field, value in params.items():
                client.log_param(run.info.run_id, field, str(value))
            t = Plan(study, space, sweep, []).ask()
            t.set_user_attr("run_name", trial.run_name)
            t.set_user_attr("mlflow_run_id", run.info.run_id)
            t.report(0.1, 0)
            if outcome == "fail":
                frozen = study.tell(t, state=TrialState.FAIL)
            elif outcome is None:
                frozen = study.tell(t, state=TrialState.PRUNED)
            else:
                t.report(outcome, 2)
                frozen = study.tell(t, outcome)
            parent.mark_trial(run.info.run_id, frozen)
        summary = parent.record(study)
    assert (summary["complete"], summary["pruned"], summary["failed"]) == (2, 1, 1)
    assert summary["best"]["trial"] == 1 and summary["best"]["params"] == space.grid[1]
    assert {"plots/optimization_history.png", "plots/parallel_coordinate.png",
            "plots/intermediate_values.png"} <= set(summary["plots"])
    assert summary["comparison"] == "comparison/comparison.png"

    again = SweepRun.open(config, sweep)  # a rerun finds the same parent run; the table is not doubled
    assert again.run_id == parent.run_id
    again.record(study)
    table = json.loads(Path(client.download_artifacts(parent.run_id, "trials.json", str(tmp_path))).read_text())
    assert [row[0] for row in table["data"]] == [0, 1, 2, 3]
    states = [row[table["columns"].index("state")] for row in table["data"]]
    assert states == ["complete", "complete", "pruned", "failed"]
    run = client.get_run(parent.run_id)
    assert run.data.tags["best.trial"] == "1" and run.data.tags["best.kl.beta"] == "0.1"
    assert run.data.metrics["sweep/best_value"] == 0.9
    pruned = client.get_run(table["data"][2][table["columns"].index("mlflow_run_id")])
    assert pruned.data.tags["sweep.state"] == "pruned" and pruned.info.status == "KILLED"
    assert find_sweep(client, "rlhf-flows", "lr-kl", mlflow_uri)[1:] == (parent.run_id, sweep)  # rlhf compare --sweep
    assert run.data.params["sweep.space.kl.beta"] == "[0.01, 0.1]" and run.data.params["sweep.sampler"] == "grid"
    labels = trial_runs(client, parent.experiment_id, parent.run_id, sweep)
    assert list(labels.values())[1] == "lr-kl-t1: reinforce.optim.lr=0.0001, kl.beta=0.1, complete"


# ------------------------------------------------------------------------------------------------ rlhf sweep
@pytest.mark.parametrize("args, expected", [
    (["--name", "x", "--space", "kl.beta=[0.01, 0.1]"], "sweep.metric: 'eval/reward' is logged by the held-out eval"),
    (["--name", "x", "--space", "kl.inti=[0.01]", "--metric", "reward"], "'kl.inti' is not a config field"),
    (["--name", "x"], "space\n  Field required"),
    (["--name", "x", "--space", "kl.beta"], "--space expects FIELD=VALUES"),
    (["--name", "x", "--space", "kl.beta=[0.1]", "--concurrency", "two"],
     "concurrency\n  Input should be a valid integer"),
])
def test_rlhf_sweep_refuses_bad_input_before_anything_starts(args, expected, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing listens there: never asked
    with pytest.raises(SystemExit) as err:
        main(["sweep", "--preset", "tiny", "--set", "algorithm=rloo", *args])
    assert str(err.value).startswith("invalid sweep: ") and expected in str(err.value)


def test_rlhf_sweep_reads_its_section_from_yaml_with_numbers_as_numbers(tmp_path, monkeypatch):
    from components.cli.sweep import load_sweep
    from components.cli.main import build_parser

    (tmp_path / "sweep.yaml").write_text("name: lr\nspace:\n  reinforce.optim.lr: [1e-5, 3e-4]\nconcurrency: 2\n")
    args = build_parser().parse_args(["sweep", "--sweep", str(tmp_path / "sweep.yaml"), "--space",
                                      "kl.beta={low: 1e-3, high: 1e-1, log: true}",
                                      "--sampler", "tpe", "--concurrency", "3"])
    sweep = load_sweep(args)
    assert sweep.space["reinforce.optim.lr"] == [1e-5, 3e-4] and sweep.space["kl.beta"].log and sweep.concurrency == 3
