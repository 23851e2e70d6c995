"""Presets and placements: the field defaults fit a real model, the tiny models' values are the tiny preset's, and a
config gets a preset (or a placement) only by naming it, never from its model; what a config sets is kept; the demo
deployments' Prefect form shows what their runs train; the gold reward is the shipped task's only on the shipped task;
`rlhf config --describe` prints every field with its description and the values presets and placements give it."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from pydantic import BaseModel, ValidationError

from components.cli.main import main
from components.cli.options import PLACEMENTS as CLI_PLACEMENTS, PRESETS as CLI_PRESETS
from components.tasks import merge_parameters
from models.config import PRESETS, RLHFConfig, RunConfig, from_layers, load_config, merge, preset
from models.deploy import PLACEMENTS, DeployConfig
from models.loop import gold_spec
from models.tiny_files import EMBEDDED_DIR

TINY_LR = 3e-4


def test_a_config_gets_the_tiny_preset_by_naming_it_never_from_its_policy(tmp_path):
    tiny = load_config(preset="tiny")
    assert (tiny.preset, tiny.model.policy, tiny.model.reward, tiny.model.dtype) == \
        ("tiny", "tiny/policy", "tiny/reward", "float32")
    assert tiny.reinforce.optim.lr == tiny.ppo.optim.lr == TINY_LR and tiny.critic.optim.lr == 1e-3
    assert tiny.generation.max_new_tokens == 16 and tiny.data.prompts == "builtin:sentiment"

    # the embedded policy named, by its name or its shipped directory, brings no preset: the field defaults
    for policy in ("tiny/policy", str(EMBEDDED_DIR / "policy")):
        plain = load_config(overrides={"model.policy": policy})
        assert plain.preset == "none" and plain.reinforce.optim.lr == plain.ppo.optim.lr == 1e-6
        assert (plain.model.dtype, plain.generation.max_new_tokens, plain.data.prompts) == ("bfloat16", 256, None)
    assert load_config().critic.optim.lr == 1e-5

    # a file names it as well as --preset does; what the file and --set give is kept over it; the flag wins the name
    run = tmp_path / "run.yaml"
    run.write_text("preset: tiny\ngeneration: {max_new_tokens: 7}\n")
    kept = load_config(run, {"reinforce.optim.lr": 5e-5})
    assert (kept.preset, kept.generation.max_new_tokens, kept.reinforce.optim.lr, kept.ppo.optim.lr) == \
        ("tiny", 7, 5e-5, TINY_LR)
    assert load_config(run, preset="none").ppo.optim.lr == 1e-6
    assert load_config(preset="tiny", overrides={"model.policy": "org/x"}).reinforce.optim.lr == TINY_LR  # as named
    with pytest.raises(ValidationError, match="preset"):
        preset("big")


def test_a_built_config_keeps_its_preset_and_placement_and_refuses_another():
    cfg = load_config(preset="tiny", placement="in_process", overrides={"iterations": 3})
    assert RLHFConfig.of(cfg.run, cfg.deploy) == cfg  # apart and composed again: the same run
    assert RLHFConfig.model_validate(cfg.model_dump(mode="json")) == cfg
    assert merge(cfg, {"preset": "tiny", "iterations": 4}).iterations == 4
    with pytest.raises(ValueError, match="preset: 'none' cannot replace 'tiny'"):
        merge(cfg, {"preset": "none"})
    with pytest.raises(ValueError, match="deploy.placement: 'cluster' cannot replace 'in_process'"):
        merge(cfg, {"deploy.placement": "cluster"})
    cfg.iterations = 5  # an assignment to one field leaves the others as they are
    assert (cfg.iterations, cfg.model.dtype, cfg.deploy.critic.launch) == (5, "float32", "in_process")


def test_a_placement_fills_what_the_deployment_leaves_unset():
    cluster = DeployConfig(placement="cluster")
    assert (cluster.actor.launch, cluster.critic.launch, cluster.reward.launch, cluster.rollout.launch) == \
        ("jobset", "kubernetes", "kubernetes", "kubernetes")
    assert cluster.rollout.python == "/opt/vllm/bin/python" and cluster.cache.hub_downloads
    given = DeployConfig.model_validate({"placement": "cluster", "reward": {"launch": "in_process"}})
    assert (given.reward.launch, given.critic.launch) == ("in_process", "kubernetes")
    assert DeployConfig(placement="local") == DeployConfig()  # the field defaults
    # a section given in part keeps the defaults of the rest of it
    assert DeployConfig.model_validate({"cluster": {"actor": {"gpus_per_node": 2}}}).cluster.actor.node_selector == \
        {"rlhf/role": "actor"}
    assert RunConfig.model_validate({"critic": {"optim": {"warmup_steps": 10}}}).critic.optim.lr == 1e-5
    # the CLI's choices (named there: its parser loads no model code) are these
    assert set(CLI_PRESETS) == set(PRESETS) and set(CLI_PLACEMENTS) == set(PLACEMENTS)


def test_a_flow_runs_parameters_merge_over_its_deployment_s_unless_they_name_another_preset():
    deployment = {"config": RunConfig(preset="tiny", algorithm="rloo").model_dump(mode="json"),
                  "deploy": {"placement": "in_process", "state_dir": "/tmp/s"}}
    partial = merge_parameters(deployment, {"config": {"iterations": 3}, "deploy": {"actor": {"nproc_per_node": 2}}})
    cfg = from_layers({**partial["config"], "deploy": partial["deploy"]})
    assert (cfg.preset, cfg.reinforce.optim.lr, cfg.iterations) == ("tiny", TINY_LR, 3)
    assert (cfg.deploy.critic.launch, cfg.deploy.state_dir, cfg.deploy.actor.nproc_per_node) == ("in_process", "/tmp/s",
                                                                                                 2)
    own = merge_parameters(deployment, {"config": {"preset": "none", "model": {"policy": "acme/qwen"}},
                                        "deploy": {"placement": "local"}})
    cfg = from_layers({**own["config"], "deploy": own["deploy"]})
    assert (cfg.preset, cfg.reinforce.optim.lr, cfg.model.reward, cfg.model.dtype) == ("none", 1e-6, None, "bfloat16")
    assert (cfg.deploy.critic.launch, cfg.deploy.state_dir) == ("local", None)  # the deployment's left out


def test_the_demo_deployment_s_prefect_form_shows_what_its_runs_train():
    """ppo/default as flows/serve.py serves it (Runner.add_flow builds it with flow.to_deployment): the values its
    form shows (its parameters over the flow's schema defaults), validated by Prefect against its parameter schema,
    are the config a run of it given nothing resolves to, field for field."""
    from prefect.utilities.schema_tools import validate

    from flows.serve import deployments

    for flow, served in deployments()[:2]:  # ppo/default, reinforce/default
        deployment = flow.to_deployment(name="default", **served)
        schema = deployment._parameter_openapi_schema.model_dump()
        shown = {name: deployment.parameters.get(name, spec.get("default"))
                 for name, spec in schema["properties"].items()}
        assert validate(shown, schema, raise_on_error=False) == [], flow.name
        merged = merge_parameters(deployment.parameters, {})
        cfg = from_layers({**merged["config"], "deploy": merged["deploy"]})
        assert shown["config"] == cfg.run.model_dump(mode="json"), flow.name
        assert DeployConfig.model_validate(shown["deploy"]) == cfg.deploy, flow.name
        assert shown["config"]["preset"] == "tiny" and cfg.reinforce.optim.lr == TINY_LR, flow.name


@pytest.mark.parametrize("prompts, gold, expected", [
    ("builtin:sentiment", None, "models.tasks.sentiment:gold_reward"),
    ("builtin:sentiment_target", None, "models.tasks.sentiment:gold_reward"),
    ("/data/math.parquet", None, None),
    ("/data/math.parquet", "rewards.py:gold", "rewards.py:gold"),
])
def test_the_gold_reward_is_the_shipped_tasks_only_on_the_shipped_task(prompts, gold, expected):
    assert gold_spec(preset("tiny", **{"data.prompts": prompts, "reward.gold": gold})) == expected


@pytest.mark.parametrize("reward, message", [
    ({"function": "a:f", "functions": ["a:g"]}, "reward.function and reward.functions are both set"),
    ({"source": "function"}, "reward.function (or reward.functions) is required"),
    ({"functions": ["a:f", "b:g"], "weights": [1.0]}, "reward.weights has 1 weight(s) for 2 reward.functions"),
    ({"function": "a:f", "weights": [1.0]}, "reward.weights weighs reward.functions"),
    ({"functions": ["a:f", "not a spec"]}, "reward.functions[1] must look like"),
    ({"function": "path/to/rewards:f"}, "reward.function must look like"),  # a path, but not to a .py file
])
def test_bad_reward_settings_are_refused_naming_the_field(reward, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        preset("tiny", **{f"reward.{k}": v for k, v in reward.items()})


def test_reward_function_names_are_the_functions_names_made_unique():
    cfg = preset("tiny", **{"reward.source": "function",
                            "reward.functions": ["my/rewards.py:exact", "pkg.mod:exact", "pkg.mod:format"],
                            "reward.weights": [1.0, 0.5, 0.1]})
    assert cfg.reward.function_names() == ["exact", "exact_2", "format"]
    assert cfg.reward.function_weights() == [1.0, 0.5, 0.1]


def leaves(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """Every leaf field of a config tree, by dotted name, with its description (walked here, independently)."""
    out = {}
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out.update(leaves(field.annotation, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = field.description
    return out


def described_lines(*args: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["config", "--describe", *args]) == 0
    return out.getvalue().splitlines()


def test_config_describe_all_prints_every_field_with_its_description_and_describe_the_user_s_fields():
    """--describe --all: every field of a run; --describe: all but those their sections mark advanced (request
    limits, threads and cores, timeouts, ports), at most 150 for a run, what a user sets; each with the values the
    presets and placements give it."""
    lines, short = described_lines("run", "--all"), described_lines()
    fields = leaves(RLHFConfig)
    assert len(fields) > 100 and all(fields.values()), [k for k, v in fields.items() if not v]
    for name, description in fields.items():
        at = next((i for i, line in enumerate(lines) if line.startswith(f"{name}  (")), None)
        assert at is not None, name
        assert lines[at + 1].strip() == description, name
    assert "generation.max_new_tokens  (int, default 256; tiny preset 16)" in lines
    assert any(line.startswith("deploy.critic.launch  (") and line.endswith(
        "default 'local'; in_process placement 'in_process'; cluster placement 'kubernetes')") for line in short)
    shown = [line.split("  (")[0] for line in short if "  (" in line and not line.startswith(" ")]
    assert len(shown) <= 150 and set(shown) < set(fields)
    hidden = set(fields) - set(shown)
    assert {"deploy.critic.port", "deploy.rollout.max_body_mib", "deploy.actor.collective_timeout_s",
            "ppo.optim.betas", "reward.files"} <= hidden
    assert {"preset", "algorithm", "model.policy", "kl.beta", "loss.epsilon_high", "deploy.placement",
            "deploy.actor.nproc_per_node", "deploy.critic.launch"} <= set(shown)


@pytest.mark.parametrize("what, field", [("deploy", "actor.nproc_per_node"), ("pipeline", "dpo.beta"),
                                         ("sft", "sft.epochs"),
                                         ("reward-model", "reward_model.center_rewards_coefficient"),
                                         ("dpo", "dpo.loss_type"), ("eval", "eval.samples_per_prompt"),
                                         ("sweep", "metric")])
def test_config_describe_covers_every_config(what, field):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["config", "--describe", what]) == 0
    lines = out.getvalue().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{field}  ("))
    assert lines[at + 1].strip()  # with its description
