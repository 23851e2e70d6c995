"""The config tree: what a run trains (RunConfig) apart from where its parts run (DeployConfig), both typed with a
description on every field; dotted overrides; deep merges; run names that stay inside their directories."""

import re

import pytest
from pydantic import BaseModel, ValidationError

from models.config import RLHFConfig, RunConfig, deep_merge, load_config, merge, nested, preset, run_name_for
from models.deploy import DeployConfig

pytestmark = pytest.mark.fast

# Where a run's parts run: none of these may appear in what a run trains.
PLACEMENT_WORDS = ("launch", "host", "port", "python", "threads", "cores", "timeout_s", "uri", "state_dir", "device",
                   "nproc", "nnodes", "master", "backend", "endpoint", "url")


def fields(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    """Every leaf field of a config class by dotted name (sections opened)."""
    out = {}
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out.update(fields(kind, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = field
    return out


def test_every_field_of_both_trees_has_a_description():
    for model in (RunConfig, DeployConfig):
        missing = [name for name, field in fields(model).items() if not (field.description or "").strip()]
        assert missing == [], f"{model.__name__} fields without a description: {missing}"


def test_what_a_run_trains_names_no_place_and_where_it_runs_is_the_deployment_s():
    run = [name for name in fields(RunConfig)
           if any(re.search(rf"(^|_){word}($|_)", name.split(".")[-1]) for word in PLACEMENT_WORDS)]
    assert run == [], f"run settings that say where a run runs: {run}"
    deploy = set(fields(DeployConfig))
    assert {"state_dir", "critic.launch", "critic.port", "reward.launch", "rollout.python", "rollout.port",
            "actor.nproc_per_node", "actor.master_port", "tracking.uri", "checkpoint.uri"} <= deploy
    assert set(RLHFConfig.model_fields) == set(RunConfig.model_fields) | {"deploy", "sources"}  # sources: set by the job


def test_a_run_and_its_deployment_compose_and_come_apart():
    run = RunConfig(algorithm="rloo", iterations=3)
    deploy = DeployConfig.model_validate({"critic": {"launch": "in_process"}, "state_dir": "/tmp/x"})
    cfg = RLHFConfig.of(run, deploy)
    assert (cfg.algorithm, cfg.iterations, cfg.deploy.critic.launch, cfg.deploy.state_dir) == ("rloo", 3, "in_process", "/tmp/x")
    assert (cfg.run.algorithm, cfg.run.iterations) == ("rloo", 3) and "deploy" not in cfg.run.model_dump()
    assert RLHFConfig.of(cfg.run, cfg.deploy) == cfg  # apart and composed again: the same run


def test_dotted_overrides_and_nested_mappings_merge_at_every_depth():
    assert nested({"a.b": 1, "a": {"c": 2}, "a.d.e": 3}) == {"a": {"b": 1, "c": 2, "d": {"e": 3}}}
    assert deep_merge({"a": {"b": 1, "c": {"d": 2}}, "x": [1]}, {"a": {"c": {"e": 3}}, "x": [2]}) == \
        {"a": {"b": 1, "c": {"d": 2, "e": 3}}, "x": [2]}
    cfg = merge(RLHFConfig(), {"deploy.reward.launch": "in_process", "model": {"dtype": "bfloat16"}})
    assert (cfg.deploy.reward.launch, cfg.model.dtype, cfg.model.policy, cfg.deploy.critic.launch) == \
        ("in_process", "bfloat16", "tiny/policy", "local")
    assert isinstance(merge(RunConfig(), {"seed": 3}), RunConfig)


def test_an_entry_point_s_defaults_sit_under_the_user_s_file_and_flags(tmp_path):
    """`rlhf train` runs its critic in process unless the user says otherwise (file or --set)."""
    defaults = {"deploy.critic.launch": "in_process"}
    assert load_config(defaults=defaults).deploy.critic.launch == "in_process"
    config_file = tmp_path / "run.yaml"
    config_file.write_text("deploy:\n  critic:\n    launch: local\niterations: 3\n")
    assert load_config(config_file, defaults=defaults).deploy.critic.launch == "local"
    assert load_config(overrides={"deploy.critic.launch": "deployment"}, defaults=defaults).deploy.critic.launch == "deployment"


@pytest.mark.parametrize("name", ["../x", "/abs/path", "a/b", ".hidden", "", "x" * 101, "spaces are bad"])
def test_a_run_name_that_could_leave_its_directory_is_refused(name):
    with pytest.raises(ValidationError, match="run_name"):
        RunConfig(run_name=name)


def test_unnamed_runs_started_together_get_names_of_their_own():
    names = {run_name_for(RunConfig(algorithm="ppo")) for _ in range(20)}
    assert len(names) == 20 and all(n.startswith("ppo-") for n in names)
    assert run_name_for(RunConfig(run_name="mine")) == "mine"


@pytest.mark.parametrize("overrides,message", [
    ({"ppo.optim.lr": -1.0}, "lr"),
    ({"reinforce.num_rollouts_per_prompt": 1}, "num_rollouts_per_prompt"),
    ({"reward.source": "function"}, r"reward.function \(or reward.functions\) is required"),
    ({"reward.function": "no colon here"}, "package.module:function"),
    ({"generation.temperature": 0}, "temperature"),
    ({"ppo.not_a_field": 1}, "not_a_field"),
    ({"critic.launch": "local"}, "launch"),  # where the critic runs is the deployment's: deploy.critic.launch
    ({"deploy.critic.port": 70000}, "port"),
    ({"deploy.actor.nproc_per_node": 128}, "rollout_batch_size=64 is smaller than the actor's world size 128"),
])
def test_invalid_config_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        preset("tiny", **overrides)
