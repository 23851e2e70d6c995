"""The config tree: what a run trains (RunConfig) apart from where its parts run (DeployConfig), both typed with one
short sentence describing every field; how a run's config is put together, layer over layer, in the documented order;
dotted overrides; deep merges; run names that stay inside their directories."""

import ast
import inspect
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from components.pipeline.config import PipelineFile
from components.sweep.config import SweepConfig
from components.sweep.experiment import ExperimentConfig
from components.tasks import merge_parameters
from models.config import (LAYERS, RLHFConfig, RunConfig, from_layers, load_config, merge, nested, preset,
                           run_name_for, with_schedule_lengths)
from models.deploy import DeployConfig
from models.kinds import JOBS_BUT_RL
from models.sections import deep_merge

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
    # sources: set by the job
    assert set(RLHFConfig.model_fields) == set(RunConfig.model_fields) | {"deploy", "sources"}


def test_a_run_and_its_deployment_compose_and_come_apart():
    run = RunConfig(algorithm="rloo", iterations=3)
    deploy = DeployConfig.model_validate({"critic": {"launch": "in_process"}, "state_dir": "/tmp/x"})
    cfg = RLHFConfig.of(run, deploy)
    assert (cfg.algorithm, cfg.iterations, cfg.deploy.critic.launch, cfg.deploy.state_dir) == ("rloo", 3, "in_process",
                                                                                               "/tmp/x")
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


def test_each_layer_of_a_run_s_config_wins_over_the_ones_before_it_in_the_documented_order(tmp_path):
    """LAYERS, which docs/reference/config.md renders, on one field of what a run trains (generation.max_new_tokens)
    and one of where it runs (deploy.critic.launch) set at every layer, on the command line and for a flow run."""
    assert [name for name, _ in LAYERS] == ["Field defaults", "Preset and placement",
                                            "The file or the deployment's parameters",
                                            "The overrides or the flow run's parameters", "Derivations"]
    def seen(cfg):
        return cfg.generation.max_new_tokens, cfg.deploy.critic.launch

    assert seen(load_config()) == (256, "local")  # 1. field defaults
    assert seen(load_config(preset="tiny", placement="in_process")) == (16, "in_process")  # 2. preset, placement
    assert seen(load_config(default_placement="in_process")) == (256, "in_process")  # a command's own placement
    run = tmp_path / "run.yaml"
    run.write_text("preset: tiny\ngeneration: {max_new_tokens: 20}\n"
                   "deploy: {placement: in_process, critic: {launch: kubernetes}}\n")
    assert seen(load_config(run, default_placement="cluster")) == (20, "kubernetes")  # 3. the file (naming 2)
    assert seen(load_config(run, {"generation.max_new_tokens": 24, "deploy.critic.launch": "local"})) == \
        (24, "local")  # 4. the overrides

    deployment = {"config": {"preset": "tiny", "generation": {"max_new_tokens": 20}},  # 3. the deployment's
                  "deploy": {"placement": "in_process", "critic": {"launch": "kubernetes"}}}
    flow_run = {"config": {"generation": {"max_new_tokens": 24}}, "deploy": {"critic": {"launch": "local"}}}
    for given, expected in (({}, (20, "kubernetes")), (flow_run, (24, "local"))):  # 4. the flow run's
        merged = merge_parameters(deployment, given)
        assert seen(from_layers({**merged["config"], "deploy": merged["deploy"]})) == expected

    # 5. derivations fill only what every layer before them left None
    cfg = load_config(preset="tiny", overrides={"iterations": 2})
    assert cfg.ppo.optim.total_steps is None and with_schedule_lengths(cfg).ppo.optim.total_steps == 2 * 2 * 2
    assert with_schedule_lengths(merge(cfg, {"ppo.optim.total_steps": 7})).ppo.optim.total_steps == 7


def config_classes() -> dict[str, type[BaseModel]]:
    """Every config class a user gives values to (a run's, a deployment's, a pipeline's, each job's, a sweep's, an
    experiment's), and every section below them, by name."""
    found: dict[str, type[BaseModel]] = {}

    def walk(cls):
        if cls.__name__ in found:
            return
        found[cls.__name__] = cls
        for field in cls.model_fields.values():
            for kind in (field.annotation, *typing.get_args(field.annotation)):
                for inner in (kind, *typing.get_args(kind)):
                    if isinstance(inner, type) and issubclass(inner, BaseModel):
                        walk(inner)

    for root in (RLHFConfig, PipelineFile, SweepConfig, ExperimentConfig, *(kind.run_class for kind in JOBS_BUT_RL)):
        walk(root)
    return found


# owned by another change: the server launch modes (their descriptions are rewritten with them)
def test_every_config_field_is_described_in_one_short_sentence_on_lines_of_at_most_120():
    classes = config_classes()
    assert len(classes) > 40
    long, sentences = [], []
    for name, cls in classes.items():
        for field, info in cls.model_fields.items():
            text = info.description or ""
            if not text or len(text) > 100:
                long.append(f"{name}.{field} [{len(text)}]")
            if re.search(r"\. [A-Z]", text.rstrip(".")):
                sentences.append(f"{name}.{field}")
    assert long == [] and sentences == [], (long, sentences)
    files = {Path(inspect.getsourcefile(cls)) for cls in classes.values()}
    wide = []
    for path in files:
        tree, lines = ast.parse(path.read_text()), path.read_text().splitlines()
        for owner in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
            for node in owner.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Call) \
                        and getattr(node.value.func, "id", None) == "Field":
                    wide += [f"{path.name}:{n}" for n in range(node.lineno, node.end_lineno + 1)
                             if len(lines[n - 1]) > 120]
    assert wide == [], wide


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
    # a server as a Prefect deployment of its own is gone: what replaces it, named
    ({"deploy.critic.launch": "deployment"},
     r"deploy.critic.launch\n.*launch='deployment' was removed: on a cluster use 'kubernetes'.*else 'local'"),
    ({"deploy.reward.launch": "deployment"}, r"deploy.reward.launch\n.*use 'kubernetes'"),
    ({"deploy.rollout.launch": "deployment"}, r"deploy.rollout.launch\n.*use 'kubernetes'"),
    ({"deploy.actor.nproc_per_node": 128}, "rollout_batch_size=64 is smaller than the actor's world size 128"),
])
def test_invalid_config_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        preset("tiny", **overrides)
