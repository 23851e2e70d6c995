"""The pipeline as one DAG, for `rlhf pipeline` and the `pipeline/default` flow alike:

    sft           supervised fine-tuning of base_model (components/stages.py), or the ready sft.model
    reward_model  Bradley-Terry from the SFT model (or base_model), or the ready reward_model.model
    rl            an RL run (components/runs.train) of the SFT policy against the reward model (PPO's critic
                  initialised from it); its policy exported as a plain model (LoRA merged)
    eval          the RL policy against the SFT policy on held-out prompts (models/stages/evaluate.py)

Each stage, in order: its key from its config, its data's digests, its upstream models' digests and the code version
(cache.py); a record for that key is reused (a Prefect task in the Cached state, `cached: true` in the summary);
otherwise the stage is built under its lock (a pipeline racing for the same key waits, then reuses it) and recorded
beside its checkpoints. `rerun_from` (`--from STAGE`) builds that stage and every one after it again, from scratch.
Before the next stage starts, a stage's output is loaded as the next stage loads it (the hand-off checks: a built
stage's right after it is saved, its result in its record; a given model's when it is named; a reused stage's
files are those checked, sha256 for sha256, under the same code and library versions, the key says). Lineage: an
MLflow parent run with the stages' runs nested, every trained model logged with its upstream models and data
digests (lineage.py).

How each named step executes is the caller's `Steps` (models/loop.py): directly, or as Prefect tasks of the flow run
(components/tasks.FlowSteps); a stage is one step, the steps of its run nest inside it.

Where Prefect's own caching fits and where not: Prefect caches a task by a key (`cache_key_fn`) in its result
storage, and isolation_level=SERIALIZABLE with a lock manager makes racing tasks run once. Here the key needs data
and model digests computed in the run, the record must live beside the checkpoints (S3 for a cluster: Prefect's S3
result storage needs prefect-aws, and its lock managers are a local file system or Redis, none shared through S3),
a reused model must still be in the store with its digests, and `rlhf pipeline` runs without a Prefect server. So the
records and the lock are ours (cache.py), and Prefect is told the outcome: a reused stage's task ends in the state
Completed named 'Cached' (what Prefect's own cache gives), with the record as its result.
"""

from __future__ import annotations

import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlparse

from prefect.context import TaskRunContext
from prefect.client.schemas.objects import State
from prefect.states import Completed

from components.pipeline.cache import Records, build_once, code_version, model_digest, stage_dir, stage_key
from components.pipeline.config import STAGE_ORDER, PipelineConfig
from components.pipeline.lineage import PipelineRun
from components.export import MODEL_KEY
from components.runs import train
from components.stages import stage_rows, train_stage
from components.storage.store import CheckpointStore
from models.config import RLHFConfig, Sampling, merge
from models.data import load_prompt_set
from models.deploy import DeployConfig
from models.distributed import SINGLE, local_device
from models.loop import DIRECT, Steps
from models.policy import load_policy_tokenizer
from models.stages.config import RewardModelRun, SFTRun
from models.stages.data import rows_digest
from models.resolve import file_digests, resolve_model
from models.stages.evaluate import check_policy, compare_policies
from models.stages.evaluate import check_reward_model as check_loaded_reward_model
from models.tiny_files import manifest_digest

STEP_NAMES = {"sft": "sft-stage", "reward_model": "reward-model-stage", "rl": "rl-stage", "eval": "eval-stage"}


class PipelineError(RuntimeError):
    """A pipeline that cannot go on; the message names the stage and why."""


@dataclass
class Outcome:
    """What the pipeline knows of a stage once it ran, was reused or was given: its record and where its model is
    on this machine."""

    record: dict
    cached: bool = False
    given: bool = False
    local_dir: str | None = None
    seconds: float = 0.0

    def summary(self) -> dict:
        out = {"cached": self.cached, "model": self.record.get("model"), "metrics": self.record.get("metrics", {}),
               "key": self.record.get("key"), "run_name": self.record.get("run_name"),
               "mlflow_run_id": self.record.get("mlflow_run_id"), "seconds": round(self.seconds, 2)}
        return {**out, "given": True} if self.given else out


@dataclass
class Pipeline:
    cfg: PipelineConfig
    deploy: DeployConfig
    steps: Steps
    records: Records
    lineage: PipelineRun
    forced: set[str] = field(default_factory=set)
    outcomes: dict[str, Outcome] = field(default_factory=dict)

    @property
    def state_dir(self) -> Path:
        return self.deploy.resolved_state_dir()


def run_pipeline(cfg: PipelineConfig, deploy: DeployConfig | None = None, steps: Steps = DIRECT,
                 rerun_from: str | None = None) -> dict:
    """Run the pipeline of `cfg` (its stages reused where their keys match); returns its summary:
    {"name", "mlflow_run_id", "seconds", "stages": {stage: {"cached", "model", "metrics", ...}}}."""
    if rerun_from is not None and rerun_from not in STAGE_ORDER:
        raise PipelineError(f"--from: unknown stage {rerun_from!r}; the stages: {', '.join(STAGE_ORDER)}")
    deploy = (deploy or DeployConfig()).model_copy(update={"state_dir": str((deploy or DeployConfig()).resolved_state_dir())})
    base = deploy.checkpoint.uri or (deploy.resolved_state_dir() / "checkpoints").as_uri()
    forced = set(STAGE_ORDER[STAGE_ORDER.index(rerun_from):]) if rerun_from else set()
    started = time.time()
    with pipeline_run(cfg, deploy, steps) as lineage:
        p = Pipeline(cfg, deploy, steps, Records(base, deploy.checkpoint.s3_endpoint_url), lineage, forced)
        steps.log(f"pipeline {cfg.name}: stages in {base}, MLflow run {lineage.run_id}"
                  + (f"; rebuilding from {rerun_from}" if rerun_from else ""))
        sft_stage(p)
        reward_model_stage(p)
        rl_stage(p)
        eval_stage(p)
        summary = {"name": cfg.name, "mlflow_run_id": lineage.run_id, "seconds": round(time.time() - started, 2),
                   "stages": {stage: p.outcomes[stage].summary() for stage in STAGE_ORDER}}
        steps.log(f"pipeline {cfg.name} finished in {summary['seconds']:.0f}s: " + ", ".join(
            f"{stage} {'given' if o.given else 'cached' if o.cached else 'built'}" for stage, o in p.outcomes.items()))
        return summary


@contextmanager
def pipeline_run(cfg: PipelineConfig, deploy: DeployConfig, steps: Steps) -> Iterator[PipelineRun]:
    lineage = steps("open-pipeline-run", PipelineRun(cfg, deploy, steps.tags()).start, retries=2)
    status = "FAILED"
    try:
        yield lineage
        status = "FINISHED"
    finally:
        lineage.close(status)


# ---------------------------------------------------------------- one stage: given, reused or built

def given(p: Pipeline, stage: str, model: str) -> Outcome:
    """A ready model named in the config: used as it is (not trained, not recorded), wherever it is
    (models/resolve.py)."""
    found = resolve_model(model, f"{stage}.model", None, p.deploy)
    outcome = Outcome({"model": model, "digest": found.digest, "provenance": found.provenance, "metrics": {}},
                      given=True, local_dir=found.path)
    p.steps.log(f"{stage}: the given model {model}")
    return outcome


def stage(p: Pipeline, name: str, inputs: tuple[dict, dict[str, str], dict[str, str]],
          build: Callable[[Pipeline, str], dict]) -> Outcome:
    """Reuse the record of the stage's key (from `inputs`: its config, data digests and upstream model digests), or
    build it (under its lock) and record it; returns the outcome."""
    config, data, upstream = inputs
    key = stage_key(name, config, data, upstream, code_version())
    started = time.time()
    record = p.steps(STEP_NAMES[name], run_or_reuse, p, name, key, build)
    if isinstance(record, State):  # a Prefect task that ended Cached gives its state back
        record = record.result()
    outcome = Outcome(record, cached=record.get("reused", False), seconds=time.time() - started)
    outcome.record = {k: v for k, v in record.items() if k != "reused"}
    if record.get("model"):
        outcome.local_dir = local_model(p, name, outcome.record)
    if not outcome.cached and record.get("model"):
        outcome.record["logged_model_id"] = p.lineage.log_model(name, outcome.record, upstream, data)
        p.records.write(name, key, outcome.record)
    p.lineage.record_stage(name, {**outcome.record, "cached": outcome.cached})
    return outcome


def run_or_reuse(p: Pipeline, name: str, key: str, build: Callable[[Pipeline, str], dict]):
    """The body of a stage's step: its valid record (reused), or a new build recorded under the stage's lock
    (cache.build_once). Inside a Prefect task a reused record ends the task as Completed named 'Cached', what
    Prefect's own cache gives."""
    record = build_once(p.records, name, key, lambda: build(p, key), p.cfg.name, p.steps.log, name in p.forced)
    if record.get("reused") and TaskRunContext.get() is not None:
        return Completed(name="Cached", data=record,
                         message=f"reused {stage_dir(name, key)} (built by pipeline {record.get('pipeline')})")
    return record


def local_model(p: Pipeline, name: str, record: dict) -> str:
    """The stage's model as a directory on this machine: the store's own directory on a local store, else a download
    (sha256-checked against the record) under <state_dir>/pipelines/models."""
    uri = record["model"]
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = Path(parsed.path if parsed.scheme else uri)
    else:
        path = p.state_dir / "pipelines" / "models" / stage_dir(name, record["key"])
        if not path.is_dir() or file_digests(path) != record["files"]:
            shutil.rmtree(path, ignore_errors=True)
            p.records.store(name, record["key"]).get_dir("model", path)
    if record.get("files") and file_digests(path) != record["files"]:
        raise PipelineError(f"{name}: the model at {uri} is not the one recorded (its files' sha256 differ)")
    return str(path)


def stage_tracking(p: Pipeline) -> dict:
    return {"experiment": p.cfg.tracking.experiment, "parent_run_id": p.lineage.run_id}


def stage_deploy(p: Pipeline) -> DeployConfig:
    """The deployment of a stage's run: the pipeline's, its checkpoints under the records' base."""
    return p.deploy.model_copy(update={"checkpoint": p.deploy.checkpoint.model_copy(update={"uri": p.records.base_uri})})


# ---------------------------------------------------------------- what each stage is made from (its key's inputs)

def sft_inputs(cfg: PipelineConfig, deploy: DeployConfig | None = None) -> tuple[dict, dict, dict]:
    """(config, data digests, upstream model digests) of the SFT stage."""
    return ({"sft": cfg.sft.model_dump(mode="json", exclude={"model"}), "seed": cfg.seed},
            stage_data(cfg.sft, "sft", deploy),
            {"base_model": model_digest(cfg.base_model, "base_model", cfg.base_revision, deploy)})


def reward_model_inputs(cfg: PipelineConfig, sft_digest: str,
                        deploy: DeployConfig | None = None) -> tuple[dict, dict, dict]:
    """... of the reward-model stage, trained from the SFT model (`sft_digest`) or from base_model."""
    init = (sft_digest if cfg.reward_model.init == "sft"
            else model_digest(cfg.base_model, "base_model", cfg.base_revision, deploy))
    return ({"reward_model": cfg.reward_model.model_dump(mode="json", exclude={"model"}), "seed": cfg.seed},
            stage_data(cfg.reward_model, "reward_model", deploy), {"init": init})


def rl_inputs(cfg: PipelineConfig, sft_digest: str, reward_digest: str,
              deploy: DeployConfig | None = None) -> tuple[dict, dict, dict]:
    """... of the RL stage: its run config without what the pipeline sets (its models, name, MLflow place)."""
    section = cfg.rl.model_dump(mode="json", exclude={"run_name": True, "seed": True,
                                                      "tracking": {"parent_run_id", "experiment"},
                                                      "model": {"policy", "reward", "critic"}})
    d, e = cfg.rl.data, cfg.rl.eval
    data = {"prompts": rows_digest(d.prompts, d.split, "rl.data.prompts", d.subset, d.revision, deploy)}
    if e.prompts and e.every:
        data["eval"] = rows_digest(e.prompts, e.split, "rl.eval.prompts", e.subset, e.revision, deploy)
    return {"rl": section, "seed": cfg.seed}, data, {"policy": sft_digest, "reward": reward_digest}


def eval_inputs(cfg: PipelineConfig, rl_digest: str, sft_digest: str, reward_digest: str,
                deploy: DeployConfig | None = None) -> tuple[dict, dict, dict]:
    """... of the eval stage: the two policies and the judge."""
    e = cfg.eval
    config = {"eval": e.model_dump(mode="json"), "seed": cfg.seed, "normalize": cfg.rl.reward.normalize,
              "max_new_tokens": e.max_new_tokens or cfg.rl.generation.max_new_tokens}
    data = {"prompts": rows_digest(e.prompts, e.split, "eval.prompts", e.subset, e.revision, deploy)}
    return config, data, {"policy": rl_digest, "reference": sft_digest, "reward": reward_digest}


def stage_data(section, name: str, deploy: DeployConfig | None = None) -> dict[str, str]:
    """Digests of a stage's training rows and held-out rows (at its subset and revision)."""
    out = {"train": rows_digest(section.data, section.split, f"{name}.data", section.subset, section.revision, deploy)}
    if section.eval_split is not None:
        source = section.eval_data or section.data
        field_name = f"{name}.eval_data" if section.eval_data else f"{name}.data"
        out["eval"] = rows_digest(source, section.eval_split, field_name, section.subset, section.revision, deploy)
    return out


def digest(p: Pipeline, stage_name: str) -> str:
    """The digest of an upstream stage's model (the sha256 of its files): what a downstream key is made from."""
    return p.outcomes[stage_name].record["digest"]


# ---------------------------------------------------------------- sft

def sft_stage(p: Pipeline) -> None:
    cfg = p.cfg
    if cfg.sft.model:
        p.outcomes["sft"] = given(p, "sft", cfg.sft.model)
        p.steps("hand-off-sft", check_policy, p.outcomes["sft"].local_dir, "sft.model")
    else:
        p.outcomes["sft"] = stage(p, "sft", sft_inputs(cfg, p.deploy), build_sft)


def build_sft(p: Pipeline, key: str) -> dict:
    """The SFT run, then its hand-off check: the model as saved loads as the RL stage loads a policy."""
    cfg = p.cfg
    run = SFTRun.model_validate({"run_name": stage_dir("sft", key), "seed": cfg.seed, "model": cfg.base_model,
                                 "model_revision": cfg.base_revision,
                                 "sft": cfg.sft.model_dump(exclude={"model"}), "tracking": stage_tracking(p),
                                 "checkpoint": cfg.checkpoint.model_dump(), "deploy": stage_deploy(p).model_dump()})
    result = train_stage(run, p.steps)
    p.steps("hand-off-sft", check_policy, result["model_dir"], "sft.model")
    return {**stage_record(result), "handoff": {"loads_as": "AutoModelForCausalLM"}}


def stage_record(result: dict) -> dict:
    """A stage run's summary as its record: small (no history), JSON."""
    keep = ("model", "files", "digest", "run_name", "mlflow_run_id", "reward_stats", "steps")
    record = {k: result[k] for k in keep if k in result}
    record["metrics"] = {k: v for k, v in result["metrics"].items() if isinstance(v, (int, float))}
    record["evals"] = result.get("evals", [])
    return record


# ---------------------------------------------------------------- reward model

def reward_model_stage(p: Pipeline) -> None:
    cfg = p.cfg
    if cfg.reward_model.model:
        p.outcomes["reward_model"] = given(p, "reward_model", cfg.reward_model.model)
        p.steps("hand-off-reward-model", check_loaded_reward_model, p.outcomes["reward_model"].local_dir, None, None,
                "reward_model.model")
    else:
        p.outcomes["reward_model"] = stage(p, "reward_model", reward_model_inputs(cfg, digest(p, "sft"), p.deploy),
                                           build_reward_model)


def build_reward_model(p: Pipeline, key: str) -> dict:
    """The reward-model run, then its hand-off check: the model as saved loads as the RL stage loads it (no newly
    initialised weight, one label), and scores its held-out pairs as its stage recorded."""
    cfg = p.cfg
    from_sft = cfg.reward_model.init == "sft"
    run = RewardModelRun.model_validate({
        "run_name": stage_dir("reward_model", key), "seed": cfg.seed,
        "model": p.outcomes["sft"].local_dir if from_sft else cfg.base_model,
        "model_revision": None if from_sft else cfg.base_revision,
        "reward_model": cfg.reward_model.model_dump(exclude={"model", "init"}), "tracking": stage_tracking(p),
        "checkpoint": cfg.checkpoint.model_dump(), "deploy": stage_deploy(p).model_dump()})
    result = train_stage(run, p.steps)
    record = stage_record(result)
    recorded = record["metrics"].get("eval/accuracy")
    pairs = (stage_rows("reward_model", cfg.reward_model, result["model_dir"], held_out_only=True, deploy=p.deploy)[1]
             if recorded is not None else None)
    accuracy = p.steps("hand-off-reward-model", check_loaded_reward_model, result["model_dir"], pairs, recorded,
                       "reward_model.model")
    if accuracy is not None:
        p.steps.log(f"hand-off: the reward model as saved scores {accuracy:.4f} of its held-out pairs right (its "
                    f"stage recorded {recorded:.4f})")
    return {**record, "handoff": {"loads_as": "AutoModelForSequenceClassification", "held_out_accuracy": accuracy,
                                  "recorded": recorded}}


# ---------------------------------------------------------------- rl

def rl_run(p: Pipeline, key: str) -> RLHFConfig:
    """The RL stage's run: the pipeline's rl section with the policy and its reference from the SFT stage, the reward
    model from the reward-model stage, the critic (PPO) initialised from the reward model; named after its key."""
    cfg = p.cfg
    return RLHFConfig.of(merge(cfg.rl, {
        "model.policy": p.outcomes["sft"].local_dir, "model.reward": p.outcomes["reward_model"].local_dir,
        "model.critic": None, "run_name": stage_dir("rl", key), "seed": cfg.seed,
        "tracking.experiment": cfg.tracking.experiment, "tracking.parent_run_id": p.lineage.run_id}), stage_deploy(p))


def rl_stage(p: Pipeline) -> None:
    p.outcomes["rl"] = stage(p, "rl", rl_inputs(p.cfg, digest(p, "sft"), digest(p, "reward_model"), p.deploy), build_rl)


def build_rl(p: Pipeline, key: str) -> dict:
    """The RL run (resumed from its checkpoints if an earlier build of this key died): the model it published (its
    last checkpoint's policy, LoRA merged onto the SFT model: components/export.py, the one export) is the stage's."""
    cfg = rl_run(p, key)
    result = train(cfg, p.steps)
    store = CheckpointStore.from_uri(result["checkpoint"], s3_endpoint_url=p.deploy.checkpoint.s3_endpoint_url)
    files = store.get_json(f"{MODEL_KEY}.sha256.json")  # what the run published, each file's sha256
    local = local_model(p, "rl", {"model": result["model"], "key": key, "files": files})
    p.steps("hand-off-rl", check_policy, local, "rl policy")  # as the eval stage loads it
    uri = result["model"]
    evals = result.get("evals", [])
    curves = {name: [m.get(name) for m in result["history"]] for name in ("reward", "objective/gold_reward",
                                                                          "objective/kl") if result["history"]
              and name in result["history"][0]}
    return {"model": uri, "files": files, "digest": manifest_digest(files), "run_name": result["run_name"],
            "mlflow_run_id": result["mlflow_run_id"], "metrics": {**result["final"], "iterations": result["iterations"]},
            "evals": evals, "curves": curves, "handoff": {"loads_as": "AutoModelForCausalLM"}}


# ---------------------------------------------------------------- eval

def eval_stage(p: Pipeline) -> None:
    cfg = p.cfg
    p.outcomes["eval"] = stage(p, "eval", eval_inputs(cfg, digest(p, "rl"), digest(p, "sft"), digest(p, "reward_model"),
                                                      p.deploy), build_eval)
    rows = p.outcomes["eval"].record.get("rows", [])
    if rows:
        metrics = p.outcomes["eval"].record["metrics"]
        p.steps.table(re.sub(r"[^a-z0-9-]+", "-", f"pipeline-{cfg.name}-eval".lower())[:128], rows,
                      f"Pipeline {cfg.name}: RL policy vs SFT policy on held-out prompts: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))


def build_eval(p: Pipeline, key: str) -> dict:
    cfg, e = p.cfg, p.cfg.eval
    policy = p.outcomes["rl"].local_dir
    prompts = load_prompt_set(e.prompts, e.split, e.prompt_key, load_policy_tokenizer(policy), field="eval.prompts",
                              subset=e.subset, revision=e.revision, deploy=p.deploy)
    prompts = prompts.head(e.max_prompts) if e.max_prompts else prompts
    sampling = Sampling.of(cfg.rl.generation, temperature=e.temperature,
                           max_new_tokens=e.max_new_tokens or cfg.rl.generation.max_new_tokens)
    tracker = p.lineage.nested(stage_dir("eval", key), tags={"stage": "eval"})
    tracker.start({"eval": e.model_dump(mode="json"), "policy": p.outcomes["rl"].record["model"],
                   "reference": p.outcomes["sft"].record["model"], "reward": p.outcomes["reward_model"].record["model"]})
    status = "FAILED"
    try:
        metrics, rows = compare_policies(policy, p.outcomes["sft"].local_dir, p.outcomes["reward_model"].local_dir,
                                         prompts, sampling, e.samples_per_prompt, e.gold, cfg.seed, e.table_rows,
                                         cfg.rl.reward.normalize, local_device(p.deploy.device, SINGLE))
        tracker.log_metrics(metrics, step=0)
        tracker.log_table(rows, step=0, name="eval")
        status = "FINISHED"
    finally:
        tracker.end(status)
    p.steps.log("eval: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    return {"metrics": metrics, "rows": rows, "run_name": stage_dir("eval", key), "mlflow_run_id": tracker.run_id}
