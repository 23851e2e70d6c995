"""A sweep over a pipeline's RL stage, without servers: `rlhf sweep --config pipeline.yaml` checks the space against
the pipeline's rl section (bad input refused naming the field), and every trial's pipeline keeps the sft and
reward-model stages of every other trial (their keys' inputs are equal: built once, reused by all), its RL stage is
the trial's, its run named after the trial and nested under the sweep."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.cli.main import main
from components.cli.sweep import is_pipeline
from components.pipeline.config import PipelineConfig
from components.pipeline.run import job_config
from components.runs import provenance
from components.tracking.provenance import digest
from components.sweep.config import SweepConfig
from components.sweep.space import check_sweep, trial_config
from flows.sweep import pipeline_trial
from models.config import RLHFConfig, merge
from models.deploy import DeployConfig
from models.resolve import pin
from models.tiny_files import EMBEDDED_DIR

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pipeline.yaml"


def test_trials_of_a_pipeline_share_its_upstream_stages():
    pipeline = PipelineConfig()
    config = RLHFConfig.of(merge(pipeline.rl, {"tracking.experiment": pipeline.tracking.experiment}))
    sweep = SweepConfig(name="lr", space={"reinforce.optim.lr": [1e-4, 1e-3]})
    check_sweep(config, sweep)
    trials = [PipelineConfig.model_validate(pipeline_trial(pipeline, trial_config(
        config, sweep, n, {"reinforce.optim.lr": lr}, "parent"), {})["config"]) for n, lr in enumerate((1e-4, 1e-3))]
    assert [t.name for t in trials] == ["lr-t0", "lr-t1"] and {t.tracking.parent_run_id for t in trials} == {"parent"}
    assert [t.rl.reinforce.optim.lr for t in trials] == [1e-4, 1e-3]
    assert trials[0].sft == trials[1].sft == pipeline.sft and trials[0].eval == pipeline.eval
    upstream = {"sft": str(EMBEDDED_DIR / "policy"), "reward_model": str(EMBEDDED_DIR / "reward")}
    keys = [{stage: digest(provenance(pin(job_config(stage, trial, DeployConfig(), upstream,
                                                     trial.tracking.parent_run_id))))
             for stage in ("sft", "reward_model", "rl")} for trial in trials]
    assert (keys[0]["sft"], keys[0]["reward_model"]) == (keys[1]["sft"], keys[1]["reward_model"])
    assert keys[0]["rl"] != keys[1]["rl"]


def test_rlhf_sweep_takes_a_pipeline_file_and_checks_its_rl_section(monkeypatch):
    assert is_pipeline(str(EXAMPLE)) and not is_pipeline(None)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing listens there: never asked
    with pytest.raises(SystemExit) as err:
        main(["sweep", "--config", str(EXAMPLE), "--name", "x", "--space", "reinforce.optim.lrr=[1e-4]"])
    assert "'reinforce.optim.lrr' is not a config field" in str(err.value)
    with pytest.raises(SystemExit) as err:
        main(["sweep", "--config", str(EXAMPLE), "--set", "rl.eval.every=0", "--name", "x",
              "--space", "reinforce.optim.lr=[1e-4]"])
    assert "sweep.metric: 'eval/reward' is logged by the held-out eval" in str(err.value)
