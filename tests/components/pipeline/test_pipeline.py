"""The whole pipeline on the tiny models (components/pipeline/run.py), in this process with a real MLflow store,
checkpoint store and a temporary Prefect server: one module-scoped series of runs read by several tests. A first run
builds every stage; a rerun reuses them all (in Prefect, each stage's task Cached); a rerun with only an RL setting
changed reuses sft and the reward model; one with other preference data retrains the reward model, rl and eval, not
sft; --from rebuilds a stage and what follows; a pipeline with a `dpo` section reuses sft and trains DPO, whose
implicit reward ranks held-out pairs by their gold preference and whose policy beats the SFT policy on the gold
reward, and one with a `kto` section does the same with KTO; the lineage and provenance are in MLflow; a reward model
without its score head stops the pipeline before its RL stage. And a stage's own flow (flows/stages.py) runs its steps
as tasks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.testing.utilities import prefect_test_harness

from components.pipeline.cache import stage_dir
from components.pipeline.config import RL_STAGES, PipelineConfig
from components.pipeline.run import STEP_NAMES, run_pipeline
from flows.stages import pipeline, sft
from models.config import merge
from models.data import builtin_rows
from models.deploy import DeployConfig
from models.reward import HandOffError
from models.metrics import find
from models.stages.config import SFTRunConfig
from tests.conftest import headroom_closed

pytestmark = pytest.mark.slow(3)

SMALL = {"name": "tiny-pipeline",
         "sft": {"max_steps": 6, "batch_size": 16, "max_eval_rows": 32},
         "reward_model": {"max_steps": 30, "batch_size": 16, "max_eval_rows": 100},
         "rl": {"preset": "tiny", "algorithm": "rloo", "iterations": 2, "checkpoint": {"every": 2},
                "reinforce": {"rollout_batch_size": 4, "num_rollouts_per_prompt": 2, "minibatch_size": 8},
                "eval": {"prompts": "builtin:sentiment", "every": 2, "max_prompts": 4, "samples_per_prompt": 1}},
         "eval": {"max_prompts": 6, "samples_per_prompt": 2, "success_threshold": -0.65}}
# sft -> dpo -> eval on the same SFT stage; the held-out implicit-reward accuracy (200 pairs: 0.895 here at 60 steps,
# 0.86 at 45) and the eval's gold reward (the task's 40 held-out prompts x 4 samples each: 0.06 -> 0.94) are what it
# is judged by
DPO = {"dpo": {"max_steps": 60, "batch_size": 32, "micro_batch_size": 32, "max_eval_rows": 200, "beta": 0.5,
               "optim": {"lr": 1e-3}},
       "eval": {"max_prompts": None, "samples_per_prompt": 4}}
# sft -> kto -> eval on the same SFT stage, on the same preference pairs unpaired (chosen desirable, rejected not):
# the eval's gold reward (the task's 40 held-out prompts x 4 samples each) is what it is judged by (0.06 -> 0.53 after
# 30 steps, 0.87 after 60, on a 2-core Xeon)
KTO = {"kto": {"max_steps": 45, "batch_size": 64, "micro_batch_size": 64, "max_eval_rows": 200, "beta": 0.5,
               "optim": {"lr": 1e-3}},
       "eval": {"max_prompts": None, "samples_per_prompt": 4}}


@pytest.fixture(scope="module")
def prefect_server():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prefect_server):
    """The series of runs, each on what the ones before it left (one state directory): the first two as the
    pipeline flow (as pipeline/default runs it), the others as `rlhf pipeline` does (no Prefect)."""
    state = tmp_path_factory.mktemp("pipeline")
    deploy = DeployConfig.model_validate({"state_dir": str(state), "tracking": {"system_metrics": False},
                                          "critic": {"launch": "in_process"}, "reward": {"launch": "in_process"}})
    cfg = PipelineConfig.model_validate(SMALL)
    rows = builtin_rows("sentiment_preference", "train")[:1500]
    (state / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = {"state": state, "cfg": cfg, "deploy": deploy}
    for name in ("first", "again"):
        flow_state = pipeline(config=cfg, deploy=deploy, return_state=True)
        out[name], out[f"{name}_flow_run"] = flow_state.result(), flow_state.state_details.flow_run_id
    out["rl_changed"] = run_pipeline(merge(cfg, {"rl.reinforce.optim.lr": 1e-4}), deploy)
    out["data_changed"] = run_pipeline(merge(cfg, {"reward_model.data": str(state / "pairs.jsonl"),
                                                   "reward_model.eval_data": "builtin:sentiment_preference",
                                                   "tracking.register_as": "tiny"}), deploy)
    out["from_reward_model"] = run_pipeline(cfg, deploy, rerun_from="reward_model")
    out["dpo"] = run_pipeline(merge(cfg, DPO), deploy)
    out["kto"] = run_pipeline(merge(cfg, KTO), deploy)
    return out


def cached(summary: dict) -> dict[str, bool]:
    return {stage: outcome["cached"] for stage, outcome in summary["stages"].items()}


def test_a_first_run_builds_every_stage(runs):
    stages = runs["first"]["stages"]
    assert list(stages) == list(RL_STAGES) and not any(cached(runs["first"]).values())
    for stage in ("sft", "reward_model", "rl"):
        assert stages[stage]["model"].startswith("file://") and stages[stage]["model"].endswith("/model")
        assert stages[stage]["key"] and stages[stage]["mlflow_run_id"]
    assert stages["sft"]["metrics"]["eval/loss"] > 0
    reward_model = stages["reward_model"]["metrics"]
    assert 0 <= reward_model["eval/accuracy"] <= 1 and reward_model["step"] == 30
    assert {"reward", "objective/gold_reward"} <= set(stages["rl"]["metrics"])
    assert {"eval/win_rate", "eval/reward", "eval/reference/reward", "eval/gold_reward", "eval/reference/gold_reward",
            "eval/gold_win_rate"} <= set(stages["eval"]["metrics"])  # an RL run's held-out eval's names
    assert stages["eval"]["metrics"]["eval/samples"] == 12  # 6 prompts x 2 samples of each policy
    # the policy's success and pass@k (as an RL run's eval reports them), from the stage's own per-sample scores
    rows = json.loads((runs["state"] / "checkpoints" / stage_dir("eval", stages["eval"]["key"]) / "record.json")
                      .read_text())["rows"]
    success = np.array([row["policy_score"] for row in rows], dtype=np.float64).reshape(6, 2) >= -0.65
    judged = stages["eval"]["metrics"]
    assert 0 < judged["eval/success"] < 1, rows  # the threshold splits the RL policy's scores (-0.87 to -0.28 here)
    assert judged["eval/success"] == pytest.approx(success.mean(), abs=1e-12)
    assert judged["eval/pass_at_1"] == pytest.approx(success.mean(axis=1).mean(), abs=1e-12)  # 1 - C(2-c,1)/C(2,1)
    assert judged["eval/pass_at_2"] == pytest.approx(success.any(axis=1).mean(), abs=1e-12)  # 1 - C(2-c,2)/C(2,2)
    assert "eval/accuracy" not in judged and [name for name in judged if find(name, "eval") is None] == []
    model = stages["reward_model"]["model"][len("file://"):]
    handoff = json.loads((Path(model).parent / "record.json").read_text())["handoff"]  # the model as saved, rescored
    assert handoff["recorded"] == stages["reward_model"]["metrics"]["eval/accuracy"]
    assert handoff["held_out_accuracy"] == pytest.approx(handoff["recorded"], abs=1 / 100)


def test_a_rerun_reuses_every_stage(runs):
    first, again = runs["first"]["stages"], runs["again"]["stages"]
    assert all(cached(runs["again"]).values())
    for stage in RL_STAGES:
        assert again[stage]["key"] == first[stage]["key"] and again[stage]["model"] == first[stage]["model"]
        assert again[stage]["mlflow_run_id"] == first[stage]["mlflow_run_id"]  # the run that built it
        assert again[stage]["metrics"] == first[stage]["metrics"]


def test_changing_only_an_rl_setting_reuses_sft_and_the_reward_model(runs):
    assert cached(runs["rl_changed"]) == {"sft": True, "reward_model": True, "rl": False, "eval": False}
    assert runs["rl_changed"]["stages"]["rl"]["key"] != runs["first"]["stages"]["rl"]["key"]


def test_other_preference_data_retrains_the_reward_model_and_what_follows_not_sft(runs):
    assert cached(runs["data_changed"]) == {"sft": True, "reward_model": False, "rl": False, "eval": False}


def test_from_a_stage_rebuilds_it_and_every_later_one(runs):
    first, again = runs["first"]["stages"], runs["from_reward_model"]["stages"]
    assert cached(runs["from_reward_model"]) == {"sft": True, "reward_model": False, "rl": False, "eval": False}
    assert again["reward_model"]["key"] == first["reward_model"]["key"]  # the same key, built again
    assert again["reward_model"]["mlflow_run_id"] != first["reward_model"]["mlflow_run_id"]  # a fresh run, not a resume
    assert (again["reward_model"]["metrics"]["eval/accuracy"]
            == pytest.approx(first["reward_model"]["metrics"]["eval/accuracy"], abs=0.02))


def test_a_dpo_pipeline_reuses_sft_and_its_policy_learns_the_gold_preference(runs):
    """sft -> dpo -> eval: the SFT stage of the RL pipeline is reused; DPO's implicit reward (beta x (log pi - log
    pi_ref)) ranks >= 0.8 of the held-out pairs (held-out templates, never trained on) as their gold preference does;
    the DPO policy closes >= 0.3 of the gold reward's headroom over the SFT policy on held-out prompts."""
    summary = runs["dpo"]
    assert list(summary["stages"]) == ["sft", "dpo", "eval"]
    assert cached(summary) == {"sft": True, "dpo": False, "eval": False}
    dpo = summary["stages"]["dpo"]["metrics"]
    assert dpo["eval/pairs"] == 200 and dpo["eval/rewards/accuracies"] >= 0.8, dpo
    assert {"train/rewards/chosen", "train/rewards/rejected", "train/rewards/accuracies", "train/rewards/margins",
            "train/logps/chosen", "train/logps/rejected"} <= set(dpo)  # TRL's names
    assert [name for name in dpo if find(name, "dpo") is None] == []  # docs/metrics.md lists what it logged
    judged = summary["stages"]["eval"]["metrics"]
    assert [name for name in judged if find(name, "eval") is None] == []
    print(f"dpo pipeline: {summary['seconds']}s (dpo {summary['stages']['dpo']['seconds']}s, eval "
          f"{summary['stages']['eval']['seconds']}s); held-out implicit-reward accuracy "
          f"{dpo['eval/rewards/accuracies']:.3f}; gold {judged['eval/reference/gold_reward']:.3f} -> "
          f"{judged['eval/gold_reward']:.3f}")
    assert judged["eval/samples"] == 160
    closed = headroom_closed(judged["eval/reference/gold_reward"], judged["eval/gold_reward"])
    assert closed >= 0.3, judged


def test_a_kto_pipeline_reuses_sft_and_raises_the_gold_reward_over_it(runs):
    """sft -> kto -> eval: the SFT stage of the RL pipeline is reused; KTO's held-out implicit reward separates the
    desirable from the undesirable completions; the KTO policy closes >= 0.3 of the gold reward's headroom over the
    SFT policy on held-out prompts."""
    summary = runs["kto"]
    assert list(summary["stages"]) == ["sft", "kto", "eval"]
    assert cached(summary) == {"sft": True, "kto": False, "eval": False}
    kto = summary["stages"]["kto"]["metrics"]
    assert {"train/kl", "eval/kl", "eval/rewards/chosen", "eval/rewards/rejected", "eval/rewards/margins",
            "eval/logps/chosen", "eval/logps/rejected"} <= set(kto)  # TRL's names
    assert [name for name in kto if find(name, "kto") is None] == []  # docs/metrics.md lists what it logged
    assert kto["eval/rewards/margins"] > 0, kto
    judged = summary["stages"]["eval"]["metrics"]
    print(f"kto pipeline: {summary['seconds']}s (kto {summary['stages']['kto']['seconds']}s); held-out margin "
          f"{kto['eval/rewards/margins']:.3f}; gold {judged['eval/reference/gold_reward']:.3f} -> "
          f"{judged['eval/gold_reward']:.3f}")
    assert judged["eval/samples"] == 160
    closed = headroom_closed(judged["eval/reference/gold_reward"], judged["eval/gold_reward"])
    assert closed >= 0.3, judged


def test_the_lineage_is_in_mlflow(runs):
    client = MlflowClient(f"sqlite:///{runs['state'] / 'mlflow.db'}")
    first, again = runs["first"], runs["again"]
    parent = client.get_run(first["mlflow_run_id"])
    assert parent.info.run_name == "tiny-pipeline" and parent.data.tags["stage.sft.cached"] == "false"
    # the eval stage's metrics as eval/eval/<name>, apart from the RL stage's held-out evals (one each iteration)
    assert [m.step for m in client.get_metric_history(parent.info.run_id, "eval/eval/win_rate")] == [0]
    steps = [m.step for m in client.get_metric_history(parent.info.run_id, "eval/reward")]
    assert 0 in steps and len(steps) == len(set(steps)), steps
    for stage in ("sft", "reward_model", "rl"):  # nested under the pipeline's run
        run = client.get_run(first["stages"][stage]["mlflow_run_id"])
        assert run.data.tags["mlflow.parentRunId"] == first["mlflow_run_id"], stage
    rerun = client.get_run(again["mlflow_run_id"])
    assert rerun.data.tags["stage.reward_model.cached"] == "true"
    assert rerun.data.tags["stage.reward_model.run"] == first["stages"]["reward_model"]["mlflow_run_id"]
    experiment = client.get_experiment_by_name("rlhf-pipelines").experiment_id
    models = {m.name: m for m in client.search_logged_models([experiment])}
    rm = models["tiny-pipeline-reward-model"]
    assert rm.tags["uri"] == first["stages"]["reward_model"]["model"]
    assert rm.tags["upstream.model"] and rm.tags["data.train"] and rm.tags["data.eval"]
    assert rm.source_run_id in {first["stages"]["reward_model"]["mlflow_run_id"],
                                runs["from_reward_model"]["stages"]["reward_model"]["mlflow_run_id"],
                                runs["data_changed"]["stages"]["reward_model"]["mlflow_run_id"]}
    assert {"tiny-pipeline-sft", "tiny-pipeline-policy"} <= set(models)
    # registered where tracking.register_as was set: the models that run built (not the sft it reused)
    changed = runs["data_changed"]["stages"]
    versions = {name: client.search_model_versions(f"name = '{name}'") for name in ("tiny-reward-model", "tiny-policy")}
    assert [v.source for v in versions["tiny-reward-model"]] == [changed["reward_model"]["model"]]
    assert [v.source for v in versions["tiny-policy"]] == [changed["rl"]["model"]]
    assert versions["tiny-policy"][0].tags["upstream.reward"]
    assert not client.search_registered_models("name = 'tiny-sft'")
    # each stage's run carries its provenance: the digest (its key), its data and models by content, the code
    built = client.get_run(first["stages"]["reward_model"]["mlflow_run_id"]).data.tags
    assert built["provenance.digest"] == first["stages"]["reward_model"]["key"]
    assert built["provenance.models.model.digest"] == first["stages"]["sft"]["digest"]  # trained from the SFT model
    assert (first["stages"]["reward_model"]["provenance"]["models"]["model"]["digest"]
            == first["stages"]["sft"]["digest"])
    assert built["provenance.data.train.digest"] and built["provenance.code.modules"] and built["job"] == "reward_model"


def test_a_reward_model_without_its_score_head_stops_the_pipeline_before_rl(runs, tiny_models):
    """The reward model given is a causal LM's checkpoint (no score head): the hand-off check fails the pipeline
    naming the weight, and no RL run starts."""
    before = sorted(p.name for p in (runs["state"] / "checkpoints").glob("rl-*"))
    cfg = merge(runs["cfg"], {"reward_model.model": tiny_models["policy"]})
    with pytest.raises(HandOffError, match=r"reward_model.model: reward model '.*policy' loads with newly initialised "
                                           r"weights \['score.weight'\]"):
        run_pipeline(cfg, runs["deploy"])
    assert sorted(p.name for p in (runs["state"] / "checkpoints").glob("rl-*")) == before


def task_states(flow_run_id) -> dict[str, list[str]]:
    """State names of a flow run's task runs, by task name."""
    with get_client(sync_client=True) as client:
        found = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200)
    out: dict[str, list[str]] = {}
    for run in found:
        out.setdefault(run.name.rsplit("-", 1)[0], []).append(run.state.name)
    return out


def test_prefect_shows_each_stage_as_a_task_and_a_reused_one_cached(runs):
    built, reused = task_states(runs["first_flow_run"]), task_states(runs["again_flow_run"])
    for name in (STEP_NAMES[stage] for stage in RL_STAGES):
        assert built[name] == ["Completed"] and reused[name] == ["Cached"], name
    assert "sft-steps" in built and "rloo-iteration" in built  # a stage's own steps nest inside its task
    assert "sft-steps" not in reused and "rloo-iteration" not in reused


def test_a_stage_flow_runs_its_steps_as_tasks(prefect_server, tmp_path):
    deploy = DeployConfig.model_validate({"state_dir": str(tmp_path), "tracking": {"system_metrics": False}})
    state = sft(config=SFTRunConfig.model_validate({"run_name": "flow-sft",
                                                    "sft": {"max_steps": 2, "max_eval_rows": 8}}),
                deploy=deploy, return_state=True)
    assert state.is_completed() and state.result()["steps"] == 2
    assert {"open-run", "sft-steps", "checkpoint", "eval",
            "export-model"} <= set(task_states(state.state_details.flow_run_id))
    assert (tmp_path / "checkpoints" / "flow-sft" / "model" / "model.safetensors").exists()
