"""The pipeline as one DAG, for `rlhf pipeline` and the `pipeline/default` flow alike:

    sft           supervised fine-tuning of base_model, or the ready sft.model
    reward_model  Bradley-Terry from the SFT model (or base_model), or the ready reward_model.model
    rl            an RL run of the SFT policy against the reward model (PPO's critic initialised from it), or scored
                  by its reward functions or environments (no reward-model stage); its policy exported as a plain
                  model (LoRA merged)
    dpo, kto      (instead of reward_model and rl, with its section) that stage on the SFT model, its frozen reference:
                  one step for every kind declared `policy_from_sft` (models/kinds.py)
    eval          the trained policy against the SFT policy on held-out prompts (models/stages/evaluate.py; after a
                  function-scored RL stage, as that run's held-out eval judges: components/jobs/evaluation.py)

Every stage is a job of the one job builder (components/runs.py), run as a stage of the pipeline: what it reads is
pinned once (models/resolve.pin), its key is the digest of the job's provenance record made from those pins
(components/tracking/provenance.py: the config fields that change what it trains, its data, reward and gold files
and upstream models by content, the code version), and the job runs with the same pins; a record for that key is
reused (a Prefect task in the Cached state, `cached: true` in the summary); otherwise the job is built under the
stage's lease (a pipeline racing for the same key waits, then reuses it) and recorded beside its checkpoints.
`rerun_from` (`--from STAGE`) builds that stage and every one after it again, from scratch. Before the next stage
starts, a stage's output is loaded as the next stage loads it (the hand-off checks: a built stage's right after it
is saved, its result in its record; a given model's when it is named; a reused stage's files are those checked,
sha256 for sha256, under the same code and library versions, the key says). Lineage: an MLflow parent run with the
stages' runs nested, every trained model logged with its upstream models and data digests (lineage.py).

How each named step executes is the caller's `Steps` (models/loop.py): directly, or as Prefect tasks of the flow run
(components/tasks.FlowSteps); a stage is one step, the steps of its job nest inside it.

Where Prefect's own caching fits and where not: Prefect caches a task by a key (`cache_key_fn`) in its result
storage, and isolation_level=SERIALIZABLE with a lock manager makes racing tasks run once. Here the key needs data
and model digests computed in the run, the record must live beside the checkpoints (S3 for a cluster: Prefect's S3
result storage needs prefect-aws, and its lock managers are a local file system or Redis, none shared through S3),
a reused model must still be in the store with its digests, and `rlhf pipeline` runs without a Prefect server. So the
records and the lease are ours (cache.py), and Prefect is told the outcome: a reused stage's task ends in the state
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

from components.jobs.stages import stage_rows
from components.pipeline.cache import Records, build_once, stage_dir
from components.pipeline.config import PipelineConfig
from components.pipeline.lineage import PipelineRun
from components.runs import provenance, train
from components.tracking.provenance import digest as record_digest
from models.config import RLHFConfig, merge
from models.deploy import DeployConfig
from models.kinds import BY_JOB, KINDS, POLICY_FROM_SFT
from models.loop import DIRECT, Steps
from models.stages.config import EvalRun, RewardModelRun, SFTRun
from models.stages.evaluate import check_policy
from models.stages.evaluate import check_reward_model as check_loaded_reward_model
from models.resolve import file_digests, pin, resolve_model

STEP_NAMES = {kind.job: f"{kind.command}-stage" for kind in KINDS}  # a stage's task: '<its kind's command>-stage'


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
        out = {"cached": self.cached, "model": self.record.get("model"), "digest": self.record.get("digest"),
               "metrics": self.record.get("metrics", {}), "key": self.record.get("key"),
               "run_name": self.record.get("run_name"), "mlflow_run_id": self.record.get("mlflow_run_id"),
               "provenance": self.record.get("provenance"), "seconds": round(self.seconds, 2)}
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
    stages = cfg.stages
    if rerun_from is not None and rerun_from not in stages:
        raise PipelineError(f"--from: {rerun_from!r} is not a stage of this pipeline; its stages: {', '.join(stages)}")
    deploy = (deploy or DeployConfig()).model_copy(
        update={"state_dir": str((deploy or DeployConfig()).resolved_state_dir())})
    base = deploy.checkpoint.uri or (deploy.resolved_state_dir() / "checkpoints").as_uri()
    forced = set(stages[stages.index(rerun_from):]) if rerun_from else set()
    started = time.time()
    with pipeline_run(cfg, deploy, steps) as lineage:
        records = Records(base, deploy.checkpoint.s3_endpoint_url, deploy.checkpoint.lease_timeout_s)
        p = Pipeline(cfg, deploy, steps, records, lineage, forced)
        steps.log(f"pipeline {cfg.name}: {' -> '.join(stages)}, stages in {base}, MLflow run {lineage.run_id}"
                  + (f"; rebuilding from {rerun_from}" if rerun_from else ""))
        for name in stages:
            STAGES[name](p)
        summary = {"name": cfg.name, "mlflow_run_id": lineage.run_id, "seconds": round(time.time() - started, 2),
                   "stages": {stage: p.outcomes[stage].summary() for stage in stages}}
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


def stage(p: Pipeline, name: str, job, handoff: Callable[[Pipeline, object, dict], dict] = lambda p, job, result: {}
          ) -> Outcome:
    """Reuse the record of the stage's key (the digest of its job's provenance record), or build it (under its lease)
    and record it; returns the outcome. `job`: the stage's job config (its sources pinned here, once: the record and
    the job are made from the same pins; its run name is the pipeline's: set here); `handoff(p, job, result)`: the
    stage's hand-off check of a built job's result, what it adds to the record."""
    job = pin(job)
    record = provenance(job)
    key = record_digest(record)
    started = time.time()

    def build(p: Pipeline, key: str) -> dict:
        result = train(job.model_copy(update={"run_name": stage_dir(name, key)}), p.steps, provenance=record)
        return {**stage_record(result), "provenance": record, **handoff(p, job, result)}

    found = p.steps(STEP_NAMES[name], run_or_reuse, p, name, key, build)
    if isinstance(found, State):  # a Prefect task that ended Cached gives its state back
        found = found.result()
    outcome = Outcome(found, cached=found.get("reused", False), seconds=time.time() - started)
    outcome.record = {k: v for k, v in found.items() if k != "reused"}
    if found.get("model"):
        outcome.local_dir = local_model(p, name, outcome.record)
    if not outcome.cached and found.get("model"):
        upstream = {k: v["digest"] for k, v in record["models"].items()}
        data = {k: v["digest"] for k, v in record["data"].items()}
        outcome.record["logged_model_id"] = p.lineage.log_model(name, outcome.record, upstream, data)
        p.records.write(name, key, outcome.record)
    p.lineage.record_stage(name, {**outcome.record, "cached": outcome.cached})
    return outcome


def stage_record(result: dict) -> dict:
    """A job's summary as its stage's record: small (no per-step history), JSON."""
    keep = ("model", "files", "digest", "run_name", "mlflow_run_id", "model_config", "steps", "evals", "rows")
    record = {k: result[k] for k in keep if k in result}
    record["metrics"] = {k: v for k, v in result["metrics"].items() if isinstance(v, (int, float))}
    return record


def run_or_reuse(p: Pipeline, name: str, key: str, build: Callable[[Pipeline, str], dict]):
    """The body of a stage's step: its valid record (reused), or a new build recorded under the stage's lease
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


def stage_deploy(p: Pipeline) -> DeployConfig:
    """Where a stage's job runs: the pipeline's deployment, its checkpoints under the records' base."""
    checkpoint = p.deploy.checkpoint.model_copy(update={"uri": p.records.base_uri})
    return p.deploy.model_copy(update={"checkpoint": checkpoint})


def job_config(stage: str, cfg: PipelineConfig, deploy: DeployConfig, upstream: dict[str, str],
               parent_run_id: str | None = None):
    """The job config of a stage (its run name aside: the pipeline names it after its key), from the pipeline's
    config, where it runs, and the local directories of the upstream stages' models (`upstream`: stage -> path).
    Every job gets the pipeline's seed, its MLflow place (nested under the pipeline's run) and its checkpoint
    cadence (the RL stage: its own rl.checkpoint)."""
    fields = {"seed": cfg.seed, "tracking": {"experiment": cfg.tracking.experiment, "parent_run_id": parent_run_id},
              "checkpoint": cfg.checkpoint.model_dump(), "deploy": deploy.model_dump()}
    if stage == "sft":
        return SFTRun.model_validate({**fields, "model": cfg.base_model, "model_revision": cfg.base_revision,
                                      "sft": cfg.sft.model_dump(exclude={"model"})})
    if stage == "reward_model":
        from_sft = cfg.reward_model.init == "sft"
        return RewardModelRun.model_validate({
            **fields, "model": upstream["sft"] if from_sft else cfg.base_model,
            "model_revision": None if from_sft else cfg.base_revision,
            "reward_model": cfg.reward_model.model_dump(exclude={"model", "init"})})
    if stage == "rl":  # the policy and its reference from the SFT stage, PPO's critic initialised from the reward model
        return RLHFConfig.of(merge(cfg.rl, {
            "model.policy": upstream["sft"], "model.reward": upstream.get("reward_model"), "model.critic": None,
            "seed": cfg.seed, "tracking.experiment": cfg.tracking.experiment, "tracking.parent_run_id": parent_run_id}),
            deploy)
    if stage in POLICY_FROM_SFT:  # the SFT model trained on preference data against itself, frozen
        return BY_JOB[stage].run_class.model_validate({**fields, "model": upstream["sft"],
                                                       stage: getattr(cfg, stage).model_dump()})
    # eval: the trained policy (RL's or a preference stage's) against the SFT policy, judged by the reward model
    # (without an RL stage: its judge) and the gold reward
    e, trained = cfg.eval, cfg.policy_stage
    section = {**e.model_dump(exclude={"max_new_tokens", "judge"}),
               "normalize": cfg.rl.reward.normalize and trained == "rl",
               "max_new_tokens": e.max_new_tokens or cfg.rl.generation.max_new_tokens,
               "top_k": cfg.rl.generation.top_k, "top_p": cfg.rl.generation.top_p}
    if trained == "rl" and "reward_model" not in cfg.stages:  # judged as the RL stage's own eval judges
        return EvalRun.model_validate({**fields, "model": upstream[trained], "reference": upstream["sft"],
                                       "reward": None,
                                       "run": cfg.rl.model_dump(mode="json", exclude_unset=True), "eval": section})
    judge = upstream["reward_model"] if trained == "rl" else cfg.judge
    return EvalRun.model_validate({**fields, "model": upstream[trained], "reference": upstream["sft"], "reward": judge,
                                   "eval": section})


def job(p: Pipeline, stage_name: str):
    """The job config of a stage of this pipeline run (`job_config` with its upstream stages' models here)."""
    upstream = {name: outcome.local_dir for name, outcome in p.outcomes.items()}
    return job_config(stage_name, p.cfg, stage_deploy(p), upstream, p.lineage.run_id)


# ---------------------------------------------------------------- the stages

def sft_stage(p: Pipeline) -> None:
    cfg = p.cfg
    if cfg.sft.model:
        p.outcomes["sft"] = given(p, "sft", cfg.sft.model)
        p.steps("hand-off-sft", check_policy, p.outcomes["sft"].local_dir, "sft.model")
        return
    p.outcomes["sft"] = stage(p, "sft", job(p, "sft"), policy_handoff("sft"))


def policy_handoff(name: str):
    """A stage's policy as saved loads as the next stage loads a policy."""
    def check(p: Pipeline, job, result: dict) -> dict:
        p.steps(f"hand-off-{name.replace('_', '-')}", check_policy, result["model_dir"], f"{name} model")
        return {"handoff": {"loads_as": "AutoModelForCausalLM"}}
    return check


def reward_model_stage(p: Pipeline) -> None:
    cfg = p.cfg
    if cfg.reward_model.model:
        p.outcomes["reward_model"] = given(p, "reward_model", cfg.reward_model.model)
        p.steps("hand-off-reward-model", check_loaded_reward_model, p.outcomes["reward_model"].local_dir, None, None,
                "reward_model.model")
        return
    p.outcomes["reward_model"] = stage(p, "reward_model", job(p, "reward_model"), reward_model_handoff)


def reward_model_handoff(p: Pipeline, job: RewardModelRun, result: dict) -> dict:
    """The reward model as saved loads as the RL stage loads it (no newly initialised weight, one label), and scores
    its held-out pairs (the stage's pinned rows, read with the saved model's tokenizer) as its stage recorded."""
    recorded = result["metrics"].get("eval/accuracy")
    pairs = stage_rows(job, result["model_dir"], held_out_only=True)[1] if recorded is not None else None
    accuracy = p.steps("hand-off-reward-model", check_loaded_reward_model, result["model_dir"], pairs, recorded,
                       "reward_model.model")
    if accuracy is not None:
        p.steps.log(f"hand-off: the reward model as saved scores {accuracy:.4f} of its held-out pairs right (its "
                    f"stage recorded {recorded:.4f})")
    return {"handoff": {"loads_as": "AutoModelForSequenceClassification", "held_out_accuracy": accuracy,
                        "recorded": recorded}}


def rl_stage(p: Pipeline) -> None:
    """The RL run; its held-out evals beside the pipeline's run at their iterations (what a sweep over the pipeline
    reads, as it reads an RL run's)."""
    p.outcomes["rl"] = stage(p, "rl", job(p, "rl"), rl_handoff)
    p.lineage.log_evals(p.outcomes["rl"].record.get("evals") or [])


def rl_handoff(p: Pipeline, job: RLHFConfig, result: dict) -> dict:
    """The RL policy as exported loads as the eval stage loads it; the run's curves beside its record."""
    policy_handoff("rl")(p, job, result)
    history = result["history"]
    curves = {name: [m.get(name) for m in history] for name in ("reward", "objective/gold_reward", "objective/kl")
              if history and name in history[0]}
    return {"metrics": {**result["final"], "iterations": result["iterations"]}, "curves": curves,
            "handoff": {"loads_as": "AutoModelForCausalLM"}}


def policy_stage(name: str) -> Callable[[Pipeline], None]:
    """The step of a stage that trains the SFT policy on preference data (DPO, KTO)."""
    def run(p: Pipeline) -> None:
        p.outcomes[name] = stage(p, name, job(p, name), policy_handoff(name))
    return run


def eval_stage(p: Pipeline) -> None:
    """The eval job; its sample table beside the pipeline's run."""
    cfg = p.cfg
    p.outcomes["eval"] = stage(p, "eval", job(p, "eval"))
    rows = p.outcomes["eval"].record.get("rows", [])
    if rows:
        metrics = p.outcomes["eval"].record["metrics"]
        trained = cfg.policy_stage
        p.steps.table(re.sub(r"[^a-z0-9-]+", "-", f"pipeline-{cfg.name}-eval".lower())[:128], rows,
                      f"Pipeline {cfg.name}: {trained} policy vs SFT policy on held-out prompts: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))


STAGES = {"sft": sft_stage, "reward_model": reward_model_stage, "rl": rl_stage, "eval": eval_stage,
          **{name: policy_stage(name) for name in POLICY_FROM_SFT}}
